"""DFlash / DSpark block drafting: a drafter in the published layout drafts what an independent
reference over transformers' hidden states drafts; greedy output is token-identical with it (prefix
hits, preemption, a structured request whose JSON still validates); sampling keeps the target's
distribution (chi-square through the engine); pools whole; DSpark's verify length follows its
confidence and the batch's load; a drafter trained briefly on the target's outputs is written,
reloads and gets drafts accepted; bad checkpoints are named."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import make_core, make_tiny_model, run_core
from test_spec_decode import chi_square, chi_square_critical, repetitive_prompts

from tokenmill.config import SpeculativeConfig
from tokenmill.loader import load_model
from tokenmill.sample.rejection_sampler import target_probs
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.block_drafter import BlockStep
from tokenmill.spec_decode.dflash import save_dflash
from tokenmill.tools import train_dflash

LAYERS = [0, 2]  # of the target's 4 (HF hidden_states[1] and [3])


def spec(kind: str, path: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        **{
            "method": kind,
            "model": path,
            "disable_by_batch_size": 64,
            "min_acceptance": 0.0,
            "min_confidence": 0.0,
            "num_speculative_tokens": 4,
            "max_verify_tokens": 64,
            **kw,
        }
    )


def random_drafter(config, kind: str, seed: int = 1):
    drafter = train_dflash.new_drafter(config, kind, 2, 6, LAYERS, seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(std=0.08)
    return drafter.eval()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    hf = make_tiny_model("llama-gqa-untied", root / "target", num_hidden_layers=4)
    loaded = load_model(str(root / "target"))
    drafters = {}
    for kind in ("dflash", "dspark"):
        drafters[kind] = random_drafter(loaded.config, kind)
        save_dflash(drafters[kind], str(root / kind))
    return str(root / "target"), hf, loaded, drafters, root


def pools_whole(core) -> None:
    core.step()  # the runner (and its drafter) drop the requests that finished in the last step
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.executor.runner.drafter.caches


def reference_block(sd: dict, c, ctx: torch.Tensor, ctx_pos, block: torch.Tensor, block_pos) -> torch.Tensor:
    """DFlash's forward as its reference writes it, from the state dict: each layer's keys and values
    are k/v_proj of the normed fused context and of the block's normed rows; non-causal attention."""

    def norm(x, w):
        return F.rms_norm(x, w.shape, w, c.rms_norm_eps)

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        ang = torch.cat([torch.outer(torch.tensor(pos).float(), inv)] * 2, -1)[:, None]
        h = c.head_dim // 2
        return x * ang.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * ang.sin()

    target = norm(ctx @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = block
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).unflatten(-1, (-1, c.head_dim))
        q = rope(norm(q, sd[p + "self_attn.q_norm.weight"]), block_pos)
        k = torch.cat([t @ sd[p + "self_attn.k_proj.weight"].T for t in (target, x)]).unflatten(-1, (-1, c.head_dim))
        v = torch.cat([t @ sd[p + "self_attn.v_proj.weight"].T for t in (target, x)]).unflatten(-1, (-1, c.head_dim))
        k = rope(norm(k, sd[p + "self_attn.k_norm.weight"]), ctx_pos + block_pos)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim), -1)
        h = h + torch.einsum("hqk,khd->qhd", att, v).flatten(1) @ sd[p + "self_attn.o_proj.weight"].T
        x = norm(h, sd[p + "post_attention_layernorm.weight"])
        mlp = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ sd[p + "mlp.down_proj.weight"].T
    return norm(h, sd["norm.weight"])


def test_published_layout_drafts_what_the_reference_drafts(target):
    """After a prompt's prefill the engine's drafts are the argmax of the reference block fed
    transformers' hidden_states[i + 1] of the listed layers, through the target's LM head."""
    model, hf, _, drafters, root = target
    config = json.loads((root / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == LAYERS
    prompt = repetitive_prompts(1, length=20)[0]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    first = int(out.logits[0, -1].argmax())
    ctx = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], -1)
    c = drafters["dflash"].config
    sd = {n: t.float() for n, t in drafters["dflash"].state_dict().items()}
    embeds = hf.model.embed_tokens.weight[[first] + [c.mask_token_id] * 4]
    n = len(prompt)
    with torch.no_grad():
        hidden = reference_block(sd, c, ctx, list(range(n)), embeds, list(range(n, n + 5)))
        want = hf.lm_head(hidden[1:]).argmax(-1).tolist()
    core = make_core(model, speculative=spec("dflash", str(root / "dflash")))
    seen = []
    run_core(
        core,
        [prompt],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        on_step=lambda co: seen.append(dict(co.last_schedule.spec_token_ids)),
    )
    assert seen[1]["0"] == want, seen


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_greedy_output_is_identical_with_a_block_drafter(target, kind):
    """Greedy outputs equal decoding without drafts, with logprobs and an opted-out request; again
    with every prompt in the prefix cache; and with a pool small enough to preempt."""
    model, _, loaded, _, root = target
    prompts = repetitive_prompts(3)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False),
    ]
    plain = run_core(make_core(model, block_size=4, loaded=loaded), prompts, params)
    core = make_core(model, block_size=4, loaded=loaded, speculative=spec(kind, str(root / kind)))
    assert run_core(core, prompts, params) == plain
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    pools_whole(core)
    assert run_core(core, prompts, params) == plain  # prefix hits: the context starts after them
    pools_whole(core)
    small = make_core(model, block_size=4, num_blocks=30, loaded=loaded, speculative=spec(kind, str(root / kind)))
    assert run_core(small, prompts, params) == plain
    assert small.scheduler.num_preemptions > 0
    pools_whole(small)


def test_sampling_through_the_engine_keeps_the_target_distribution(target, trained):
    """Many seeded requests sample three tokens (top-k 4) with a trained drafter; the second comes out of
    a verify step (drafts after the first, often accepted) and is distributed as the target's
    sum over t of p(t | prompt) p(. | prompt, t)."""
    model, hf, loaded, _, _ = target
    prompt, n = training_prompts()[1], 300
    params = [SamplingParams(temperature=1.0, top_k=4, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1:], params[0])[0]
        firsts = p1.nonzero()[:, 0]
        following = hf(torch.tensor([prompt + [int(t)] for t in firsts])).logits[:, -1]
        p2 = (p1[firsts, None] * target_probs(following, params[0])).sum(0)
    wide = spec("dflash", trained[0], disable_by_batch_size=512, max_verify_tokens=1024)
    core = make_core(model, loaded=loaded, max_num_seqs=256, speculative=wide)
    outs = run_core(core, [prompt] * n, params)
    seconds = torch.bincount(torch.tensor([o[1] for o in outs.values()]), minlength=256).float()
    stat, df = chi_square(seconds, p2, n)
    assert df > 4 and stat < chi_square_critical(df)
    stats = core.scheduler.spec_stats
    assert stats.num_draft_tokens >= n and stats.num_accepted_tokens > 0.1 * n
    pools_whole(core)


def test_dspark_verifies_by_confidence_and_load(target):
    """With a constant confidence of 0.8, a request verifies drafts while 0.8^j >= min_confidence; past
    compute_bound_tokens rows a draft must yield the step's expected tokens per row, so a
    compute-bound batch verifies fewer, a large one none."""
    _, _, loaded, drafters, _ = target
    module = drafters["dspark"]
    with torch.no_grad():
        module.confidence_head.weight.zero_()
        module.confidence_head.bias.fill_(math.log(0.8 / 0.2))
    hidden = torch.randn(4 * 7, 64)
    rows = [range(i * 7 + 1, i * 7 + 7) for i in range(4)]
    lm_head = loaded.model.compute_logits
    embed = loaded.model.model.embed_tokens

    def drafts(num_requests, min_confidence, bound):
        with torch.inference_mode():
            step = BlockStep(lm_head, embed, num_requests, min_confidence, bound)
            return [len(d) for d in module.propose(hidden, rows, [1, 2, 3, 4], step)]

    assert drafts(4, 0.0, 1000) == [6] * 4
    assert drafts(4, 0.3, 1000) == [5] * 4  # 0.8^5 = 0.33, 0.8^6 = 0.26
    # compute-bound past 8 rows: 4 decodes + 4 first drafts fill them, expecting 4 + 4 * 0.8 tokens;
    # a 9th row must yield 7.2 / 9 = 0.8 > 0.64
    assert drafts(4, 0.3, 8) == [1] * 4
    assert drafts(4, 0.3, 12) == [2] * 4  # 12 rows free; the 13th needs (4 + 3.2 + 2.56) / 13 = 0.75
    assert drafts(64, 0.3, 16) == [0] * 4  # a large batch: 64 / 65 > 0.8


def test_structured_output_validates_with_block_drafts(default_model, tokenizer, tmp_path):
    """A JSON-schema request on the default model with a DFlash drafter (its layers silenced: every
    draft is the token "1", which the grammar often allows): drafts are cut by the grammar and
    verified, the text validates, and it is the text decoded without drafts."""
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.executor.uniproc import UniProcExecutor
    from tokenmill.structured import StructuredOutputSpec
    from tokenmill.structured.backend import TokenizerData

    one = tokenizer.encode("1", add_special_tokens=False)[0]
    drafter = train_dflash.new_drafter(default_model.config, "dflash", 1, 5, [1, 15], 0)
    drafter.config.mask_token_id = one
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save_dflash(drafter, str(tmp_path / "d"))
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 4}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List four numbers like 11, 111."}])
    params = SamplingParams(temperature=0, max_tokens=32, structured_output=StructuredOutputSpec.json(schema))
    outs = []
    for speculative in (None, spec("dflash", str(tmp_path / "d"))):
        config = EngineConfig(cache=CacheConfig(num_blocks=64), speculative=speculative)
        executor = UniProcExecutor(config, default_model)
        core = EngineCore(config, executor, tokenizer.eos_token_ids, TokenizerData.from_tokenizer(tokenizer))
        outs.append(run_core(core, [prompt], params)["0"])
    assert outs[0] == outs[1]
    json_text = tokenizer.decode(outs[1])
    assert len(json.loads(json_text)) == 4
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    pools_whole(core)


def training_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (12,), generator=gen).tolist() for _ in range(8)]


def train(model: str, loaded, kind: str, path: str) -> tuple[list[float], list[float]]:
    """Train a drafter for a few seconds on the target's greedy continuations of 8 random prompts (as
    `tokenmill train-draft-head --kind dflash|dspark` does on a corpus) and write it to `path`: (the
    epochs' losses, held-out acceptance by position)."""
    prompts = training_prompts()
    outs = run_core(
        make_core(model, loaded=loaded), prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    sequences = [p + outs[str(i)] for i, p in enumerate(prompts)]
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(model)
        aux = [
            torch.cat([hf(torch.tensor([s]), output_hidden_states=True).hidden_states[i + 1][0] for i in LAYERS], -1)
            for s in sequences
        ]
    embedding, weight = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    drafter = train_dflash.new_drafter(loaded.config, kind, 1, 5, LAYERS, 0)
    data = [(a, s, 12) for a, s in zip(aux, sequences)]
    losses = train_dflash.train_blocks(drafter, data, embedding, weight, epochs=12, lr=3e-3, seed=0)
    save_dflash(drafter, path)
    return losses, train_dflash.held_out_acceptance(drafter, data, embedding, weight, 1)


@pytest.fixture(scope="module")
def trained(target):
    """A briefly trained DSpark checkpoint (its block rows are a DFlash drafter: it also loads as
    `dflash`), its losses and held-out acceptance by position."""
    model, _, loaded, _, root = target
    path = str(root / "trained")
    return path, *train(model, loaded, "dspark", path)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_briefly_trained_drafter_is_written_reloads_and_gets_drafts_accepted(target, trained, kind):
    """The trained drafter's held-out acceptance of its first draft is high (and falls along the
    block); the checkpoint it wrote reloads, and the engine accepts its drafts with the target's own
    greedy output."""
    model, _, loaded, _, _ = target
    path, losses, by_position = trained
    assert losses[-1] < losses[0] and by_position[0] > 0.5 and by_position == sorted(by_position, reverse=True)
    prompts = training_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    core = make_core(model, loaded=loaded, speculative=spec(kind, path))
    assert run_core(core, prompts, params) == run_core(make_core(model, loaded=loaded), prompts, params)
    stats = core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    pools_whole(core)


def test_bad_checkpoints_are_named(target, tmp_path):
    model, _, _, _, root = target
    config = json.loads((root / "dflash" / "config.json").read_text())

    def write(name: str, source: str = "dflash", **changes) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
        (tmp_path / name / "model.safetensors").symlink_to(root / source / "model.safetensors")
        return str(tmp_path / name)

    cases = [
        ("layers", {"dflash_config": {"mask_token_id": 255, "target_layer_ids": [0, 3]}}, "target_layer_ids must be"),
        ("hidden", {"hidden_size": 32}, "hidden_size is 32, the target's is 64"),
        ("causal", {"layer_types": ["sliding_attention"] * 2}, "only non-causal full_attention"),
        ("mask", {"dflash_config": {"mask_token_id": 999, "target_layer_ids": LAYERS}}, "mask_token_id 999"),
        ("arch", {"architectures": ["DFlash2DraftModel"]}, "is not DFlashDraftModel"),
        (
            "shape",
            {"intermediate_size": 100},
            r"mlp.down_proj.weight has shape \(64, 128\), config.json says \(64, 100\)",
        ),
    ]
    for name, changes, message in cases:
        with pytest.raises(ValueError, match=message):
            make_core(model, speculative=spec("dflash", write(name, **changes)))
    with pytest.raises(ValueError, match="dspark_config.spark_rank must be a positive integer"):
        make_core(model, speculative=spec("dspark", write("plain")))
    # a DSpark checkpoint read as DFlash: its heads are left out
    make_core(model, speculative=spec("dflash", str(root / "dspark")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_core(model, speculative=spec("dflash", str(tmp_path)))
    with pytest.raises(ValueError, match="is required by methods medusa and draft_model and eagle3 and dflash"):
        SpeculativeConfig(method="dflash")
    with pytest.raises(ValueError, match="min_confidence must be in"):
        SpeculativeConfig(method="dspark", model="x", min_confidence=1.5)
