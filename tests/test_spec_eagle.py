"""EAGLE-3 speculation: a drafter written in the published checkpoint layout loads and computes what the
plain-torch drafter computes; greedy output with it is token-identical to decoding without it;
seeded sampling is reproducible; the target's KV pool and the drafter's come back whole, also after
aborts; a drafter trained briefly on the target's own outputs gets drafts accepted; bad checkpoints
are named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import make_core, make_tiny_model, run_core
from test_spec_decode import repetitive_prompts

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.hidden_drafter import Feed
from tokenmill.tools import train_eagle

AUX = (0, 1, 3)  # of the target's 4 layers (the default 2, L // 2, L - 3 needs L >= 6)


def eagle_spec(path: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        **{
            "method": "eagle3",
            "model": path,
            "disable_by_batch_size": 64,
            "min_acceptance": 0.0,
            "num_speculative_tokens": 3,
            **kw,
        }
    )


def random_drafter(config, seed: int = 1) -> train_eagle.Eagle3Trainable:
    """Random weights over a draft vocabulary of every other target token (d2t non-trivial)."""
    drafter = train_eagle.new_drafter(config, torch.arange(0, config.vocab_size, 2), seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(std=0.08)
    return drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    make_tiny_model("llama-gqa-untied", root / "target", num_hidden_layers=4)
    loaded = load_model(str(root / "target"))
    drafter = random_drafter(loaded.config)
    train_eagle.save_drafter(drafter, loaded.config, AUX, str(root / "drafter"))
    return str(root / "target"), str(root / "drafter"), drafter, root


def pools_whole(core) -> None:
    core.step()  # the runner (and its drafter) drop the requests that finished in the last step
    assert core.kv.num_free_blocks == core.kv.num_blocks
    pool = core.executor.runner.drafter.pool
    assert not pool.states and len(pool.free) == pool.num_blocks


def test_published_layout_loads_the_drafter_it_was_written_from(target):
    """The engine's drafter (paged attention over its own KV) gives the plain-torch drafter's logits,
    fed the target's hidden states entering layers 0, 1 and 3."""
    model, path, drafter, _ = target
    core = make_core(model, speculative=eagle_spec(path))
    runner = core.executor.runner
    assert json.loads(open(f"{path}/config.json").read())["architectures"] == ["LlamaForCausalLMEagle3"]
    tokens = repetitive_prompts(1, length=20)[0]
    with torch.inference_mode():
        runner.forward(np.asarray(tokens), np.asarray([len(tokens)]), np.asarray([0]), [[list(range(2))]])
        aux = runner.model.model.aux_hidden.clone()
    assert aux.shape == (len(tokens), 3 * 64)
    with torch.inference_mode():  # a decode step runs the layers between 0, 1 and 3 as compiled steps
        runner.forward(np.asarray(tokens[:-1]), np.asarray([len(tokens) - 1]), np.asarray([0]), [[list(range(2))]])
        runner.forward(np.asarray(tokens[-1:]), np.asarray([1]), np.asarray([len(tokens) - 1]), [[list(range(2))]])
        torch.testing.assert_close(runner.model.model.aux_hidden[0], aux[-1], rtol=1e-5, atol=1e-5)
    assert runner.model.model.aux_decode[1] is not None
    proposer = runner.drafter
    drafts = proposer.step({"x": Feed(tokens + [7], 0, aux)}, {"x": 1})
    embedding = runner.model.model.embed_tokens.weight.detach()
    with torch.no_grad():
        want = drafter(aux, embedding[torch.tensor(tokens[1:] + [7])])
    assert drafts["x"] == [int(want[-1].argmax()) * 2]  # draft id i is target id 2i
    with torch.inference_mode():  # the drafter's own logits at the last position, against the reference
        hidden = proposer.pool.forward(["x"], [tokens[1:] + [7]], [0], [proposer.module.combine(aux)])
        torch.testing.assert_close(proposer.module.compute_logits(hidden)[0], want[-1], rtol=1e-4, atol=1e-4)
    proposer.finish("x")


def test_greedy_output_is_identical_with_an_eagle3_drafter(target):
    model, path, _, _ = target
    prompts = repetitive_prompts(4)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    params = [
        greedy,
        greedy,
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False),
    ]
    plain = run_core(make_core(model, block_size=8), prompts, params)
    core = make_core(model, block_size=8, speculative=eagle_spec(path), max_num_batched_tokens=64)
    drafted = set()
    assert run_core(core, prompts, params, on_step=lambda c: drafted.update(c.last_schedule.spec_token_ids)) == plain
    assert drafted and drafted <= {"0", "1", "2"} and core.scheduler.spec_stats.num_draft_tokens > 0
    pools_whole(core)
    # again, now with every prompt's blocks in the prefix cache: the drafter starts after the hit
    assert run_core(core, prompts, params) == plain
    pools_whole(core)


def test_seeded_sampling_is_reproducible_and_aborts_return_blocks(target):
    model, path, _, _ = target
    core = make_core(model, speculative=eagle_spec(path))
    seeded = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(2)]
    prompts = repetitive_prompts(2)
    assert run_core(core, prompts, seeded) == run_core(core, prompts, seeded)
    pools_whole(core)
    for i, p in enumerate(repetitive_prompts(3)):
        core.add_request(EngineCoreRequest(f"a{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    for _ in range(3):
        core.step()
    assert core.executor.runner.drafter.pool.states
    core.abort_requests(["a0", "a2"])
    while core.has_unfinished():
        core.step()
    pools_whole(core)


def test_preemption_shared_prefixes_and_a_small_drafter_pool(target, monkeypatch):
    """Requests preempted by a small target pool, prompts sharing a cached prefix (the drafter starts
    after the hit), a drafter pool with room for about one request (the others lose their cache and
    start again where they are): the same greedy tokens, and every block back in both pools."""
    from tokenmill.spec_decode import draft_pool

    model, path, _, _ = target
    monkeypatch.setattr(draft_pool, "DRAFT_CONTEXT_TOKENS", 64)  # 1 x 16 blocks + 1 of 4 tokens
    base = repetitive_prompts(1, 40)[0]
    prompts = [base + [i, i + 1] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = run_core(make_core(model, block_size=4, num_blocks=40), prompts, greedy)
    core = make_core(model, block_size=4, num_blocks=40, speculative=eagle_spec(path, disable_by_batch_size=1))
    assert run_core(core, prompts, greedy) == plain
    assert core.scheduler.num_preemptions > 0 and core.scheduler.spec_stats.num_draft_tokens > 0
    pools_whole(core)


def test_a_briefly_trained_drafter_gets_drafts_accepted(target):
    """Trained for a few seconds on the target's greedy continuations of a few prompts (as `tokenmill
    train-draft-head --kind eagle3` does on a corpus), the drafter's drafts are often the target's own
    next tokens when it continues them again, and the output is still the target's."""
    model, _, _, root = target
    loaded = load_model(model)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (12,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = run_core(make_core(model, loaded=loaded), prompts, params)
    sequences = [p + outs[str(i)] for i, p in enumerate(prompts)]
    runner = make_core(model, speculative=eagle_spec(str(root / "drafter"))).executor.runner
    aux = []
    with torch.inference_mode():
        for seq in sequences:
            runner.forward(np.asarray(seq), np.asarray([len(seq)]), np.asarray([0]), [[list(range(3))]])
            aux.append(runner.model.model.aux_hidden.clone())
    drafter = train_eagle.new_drafter(loaded.config, train_eagle.frequent_tokens(sequences, [12] * 8, 64), 0)
    data = train_eagle.examples(aux, sequences, runner.model.model.embed_tokens.weight, drafter)
    losses = train_eagle.train_drafter(drafter, data, epochs=8, lr=3e-3, seed=0)
    assert losses[-1] < losses[0] and train_eagle.top1_accuracy(drafter, data) > 0.5
    train_eagle.save_drafter(drafter, loaded.config, AUX, str(root / "trained"))
    core = make_core(model, loaded=loaded, speculative=eagle_spec(str(root / "trained")))
    assert run_core(core, prompts, params) == outs
    stats = core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0


def test_bad_eagle3_checkpoints_are_named(target, tmp_path):
    model, path, _, _ = target
    config = json.loads(open(f"{path}/config.json").read())

    def write(name: str, **changes) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
        (tmp_path / name / "model.safetensors").symlink_to(f"{path}/model.safetensors")
        return str(tmp_path / name)

    with pytest.raises(ValueError, match="target_hidden_size .* is 32, the target's hidden size is 64"):
        make_core(model, speculative=eagle_spec(write("hidden", target_hidden_size=32)))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids must name 3 different layers"):
        make_core(
            model, speculative=eagle_spec(write("aux", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}))
        )
    with pytest.raises(ValueError, match="field draft_vocab_size must be a positive integer"):
        make_core(model, speculative=eagle_spec(write("vocab", draft_vocab_size=0)))
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(128, 64\), config.json fields draft_vocab_size"):
        make_core(model, speculative=eagle_spec(write("shape", draft_vocab_size=100)))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_core(model, speculative=eagle_spec(str(tmp_path)))
    with pytest.raises(ValueError, match="is required by methods medusa and draft_model and eagle3"):
        SpeculativeConfig(method="eagle3")
