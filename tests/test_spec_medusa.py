"""Medusa heads: both published checkpoint layouts load the same heads, greedy output with them is
token-identical to decoding without them (tiny models and SmolLM2), the KV pool comes back whole,
and `tokenmill train-draft-head` trains heads on SmolLM2 that load, draft and get accepted."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import make_core, make_tiny_model, run_core
from safetensors.torch import save_file
from test_server_utils import MODEL, model_available, running_server
from test_spec_decode import repetitive_prompts

from tokenmill.config import SpeculativeConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.medusa import MedusaHeads, load_medusa_heads, save_medusa_heads


def random_heads(num_heads: int, hidden: int, vocab: int, own_lm_heads: bool, scale: float = 0.05) -> MedusaHeads:
    torch.manual_seed(3)
    heads = MedusaHeads(num_heads, 2, hidden, vocab, own_lm_heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=scale)
    return heads


def test_both_checkpoint_layouts_load_the_same_heads(tmp_path):
    heads = random_heads(3, 16, 40, own_lm_heads=True)
    save_medusa_heads(heads, str(tmp_path / "medusa"), "tiny")
    vllm_dir = tmp_path / "vllm"  # vLLM's names for the same tensors
    vllm_dir.mkdir()
    tensors = {
        f"blocks.{i}.layers.{j}.{kind}": getattr(linear, kind).detach().clone()
        for i, layers in enumerate(heads.blocks)
        for j, linear in enumerate(layers)
        for kind in ("weight", "bias")
    }
    tensors.update({f"lm_heads.{i}.weight": h.weight.detach().clone() for i, h in enumerate(heads.lm_heads)})
    save_file(tensors, str(vllm_dir / "model.safetensors"))
    (vllm_dir / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2}))
    x = torch.randn(5, 16)
    want = heads.logits(x, None)
    for path in (tmp_path / "medusa", vllm_dir):
        loaded = load_medusa_heads(str(path), 16, 40)
        assert loaded.lm_heads is not None
        torch.testing.assert_close(loaded.logits(x, None), want, rtol=0, atol=0)
    assert load_medusa_heads(str(vllm_dir), 16, 40).propose(x, None, 2) == want[:2].argmax(-1).T.tolist()


def test_tied_heads_use_the_targets_lm_head_and_bad_checkpoints_are_named(tmp_path):
    heads = random_heads(2, 16, 40, own_lm_heads=False)
    save_medusa_heads(heads, str(tmp_path / "tied"), "tiny")
    loaded = load_medusa_heads(str(tmp_path / "tied"), 16, 40)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    x = torch.randn(3, 16)
    states = heads.head_states(x, 2)
    torch.testing.assert_close(loaded.logits(x, lm_head), torch.stack([lm_head(s) for s in states]))
    with pytest.raises(ValueError, match=r"has shape \(16,\), the target \(hidden 32"):
        load_medusa_heads(str(tmp_path / "tied"), 32, 40)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_medusa_heads(str(tmp_path), 16, 40)
    with pytest.raises(ValueError, match="is required by methods medusa and draft_model"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="only by them"):
        SpeculativeConfig(method="ngram", model=str(tmp_path))


def identity_heads(path, hidden: int, vocab: int, perturbed: int = 1) -> str:
    """Heads whose blocks start at the identity (x + SiLU(0) = x, as the trainer starts them): each
    drafts the token the target's LM head gives h_t, i.e. repeats the newest token; head `perturbed`
    gets small random weights, so some of its drafts differ and are rejected."""
    heads = MedusaHeads(3, 1, hidden, vocab, own_lm_heads=False)
    with torch.no_grad():
        for i, layers in enumerate(heads.blocks):
            for linear in layers:
                torch.nn.init.zeros_(linear.bias)
                if i == perturbed:
                    linear.weight.normal_(std=0.3)
                else:
                    torch.nn.init.zeros_(linear.weight)
    save_medusa_heads(heads, str(path), "tiny")
    return str(path)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias", "gemma2"])
def test_greedy_output_is_identical_with_medusa_heads(tmp_path, name):
    """Medusa drafts verified in batches with requests that do not speculate; every block returns."""
    hf = make_tiny_model(name, tmp_path / "model")
    heads = identity_heads(tmp_path / "heads", hf.config.hidden_size, hf.config.vocab_size)
    spec = SpeculativeConfig(
        method="medusa", model=heads, num_speculative_tokens=3, disable_by_batch_size=64, min_acceptance=0.0
    )
    prompts = repetitive_prompts(5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [
        greedy,
        greedy,
        greedy,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False),
    ]
    plain = run_core(make_core(str(tmp_path / "model"), block_size=8), prompts, params)
    core = make_core(str(tmp_path / "model"), block_size=8, speculative=spec)
    drafted = set()
    got = run_core(core, prompts, params, on_step=lambda c: drafted.update(c.last_schedule.spec_token_ids))
    assert got == plain
    stats = core.scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert drafted and drafted <= {"0", "1", "2", "3"}  # all but the request that opted out
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_seeded_sampling_with_medusa_is_reproducible(tmp_path):
    hf = make_tiny_model("llama-gqa-untied", tmp_path / "model")
    heads = identity_heads(tmp_path / "heads", hf.config.hidden_size, hf.config.vocab_size)
    spec = SpeculativeConfig(method="medusa", model=heads, disable_by_batch_size=64, min_acceptance=0.0)
    core = make_core(str(tmp_path / "model"), speculative=spec)
    seeded = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    prompts = repetitive_prompts(3)
    assert run_core(core, prompts, seeded) == run_core(core, prompts, seeded)
    assert core.scheduler.spec_stats.num_drafts > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    """Heads trained on SmolLM2's own outputs, small settings (the benchmark trains the full ones)."""
    if not model_available():
        pytest.skip(f"{MODEL} is not installed")
    from tokenmill.tools.train_head import TrainOptions, train_draft_head

    out = tmp_path_factory.mktemp("heads")
    opts = TrainOptions(num_heads=2, num_prompts=24, prompt_tokens=48, max_tokens=48, epochs=2, lr=3e-3, progress=False)
    report = train_draft_head(MODEL, str(out), opts)
    return str(out), report


def test_trained_heads_learn_and_load_like_published_ones(trained_heads):
    path, report = trained_heads
    assert report.positions > 500 and len(report.accuracy) == 2
    assert report.loss_last[0] < report.loss_first[0]  # training lowers the loss
    config = json.loads(open(f"{path}/config.json").read())
    assert config["medusa_num_heads"] == 2 and config["tied_lm_head"] is True
    assert config["training"]["held_out_top1_accuracy"] == [round(a, 4) for a in report.accuracy]
    heads = load_medusa_heads(path, 576, 49152)
    assert heads.num_heads == 2 and heads.lm_heads is None
    # on text like their training text (corpus passages) their drafts get accepted
    from tokenmill import LLM
    from tokenmill.bench.datasets import corpus_text

    spec = {"method": "medusa", "model": path, "min_acceptance": 0.0}
    llm = LLM(MODEL, num_kv_blocks=256, speculative_config=spec)  # 256 blocks: room for both prompts
    ids = llm.get_tokenizer().encode(corpus_text())
    llm.generate(
        [{"prompt_token_ids": ids[s : s + 48]} for s in (5000, 20000)],
        SamplingParams(temperature=0, max_tokens=64),
        use_tqdm=False,
    )
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts > 50 and stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def medusa_server(tmp_path_factory, trained_heads):
    spec = json.dumps(
        {"method": "medusa", "model": trained_heads[0], "num_speculative_tokens": 2, "min_acceptance": 0.0}
    )
    yield from running_server(
        tmp_path_factory, "medusa", "--dtype", "float32", "--num-kv-blocks", "256", "--speculative-config", spec
    )


def test_server_with_trained_heads_keeps_the_greedy_text_and_reports_drafting(medusa_server, exact_llm):
    """The real server with the official client: the same greedy text as without speculation
    (in-process, exact mode), drafts verified, drafting and verifying time in /metrics."""
    client = medusa_server.openai_client()
    messages = [{"role": "user", "content": "List the days of the week, one per line."}]
    got = (
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
        .choices[0]
        .message.content
    )
    want = exact_llm.chat(messages, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0].text
    assert got == want
    metrics = httpx.get(f"{medusa_server.url}/metrics").text

    def value(name: str) -> float:
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))

    assert value("tokenmill:spec_decode_num_drafts_total") > 0
    assert "tokenmill:spec_decode_num_accepted_tokens_total" in metrics  # how many: the heads' luck on this text
    assert value("tokenmill:spec_decode_draft_seconds_total") > 0
    assert value("tokenmill:spec_decode_verify_seconds_total") > 0
