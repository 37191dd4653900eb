"""Draft-model speculation: greedy output token-identical to decoding without it, with a draft that
agrees (the target itself) and one that mostly does not (another random model); the draft's own KV
pool and the target's come back whole; seeded sampling reproducible; clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import all_logits, make_core, make_tiny_model, run_core
from test_spec_decode import repetitive_prompts

from tokenmill.config import EngineConfig, ParallelConfig, SpeculativeConfig
from tokenmill.sampling_params import SamplingParams


def draft_spec(model: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        **{"method": "draft_model", "model": model, "disable_by_batch_size": 64, "min_acceptance": 0.0, **kw}
    )


def propose(proposer, **wanted) -> dict[str, list[int]]:
    """Greedy drafts for requests given as name=(tokens, k, tokens left)."""
    from tokenmill.spec_decode.draft_model import DraftRequest

    drafts, probs = proposer.draft({r: DraftRequest(*w) for r, w in wanted.items()})
    assert not probs  # greedy drafts carry no distributions
    return drafts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    make_tiny_model("llama-gqa-untied", root / "target")
    make_tiny_model("llama-gqa-untied", root / "other", num_hidden_layers=1, initializer_range=0.05)
    return str(root / "target"), str(root / "other")


@pytest.mark.parametrize("which", ["itself", "other"])
def test_greedy_output_is_identical_with_a_draft_model(models, which):
    target, other = models
    draft = target if which == "itself" else other
    prompts = repetitive_prompts(5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [
        greedy,
        greedy,
        greedy,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False),
    ]
    plain = run_core(make_core(target, block_size=8), prompts, params)
    core = make_core(target, block_size=8, speculative=draft_spec(draft, num_speculative_tokens=3))
    drafted = set()
    assert run_core(core, prompts, params, on_step=lambda c: drafted.update(c.last_schedule.spec_token_ids)) == plain
    stats = core.scheduler.spec_stats
    assert drafted and drafted <= {"0", "1", "2", "3"} and stats.num_draft_tokens > 0  # "4" opted out
    if which == "itself":  # the target drafting for itself: (nearly) every draft is its own greedy token
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert core.kv.num_free_blocks == core.kv.num_blocks
    core.step()  # the runner (and its draft) drop the requests that finished in the last step
    pool = core.executor.runner.drafter.pool
    assert not pool.states and len(pool.free) == pool.num_blocks


def test_the_draft_pool_runs_a_model_as_the_runner_does(models):
    """The draft's own KV pool runs its model through the runner's paged forward (`layers.paged_forward`),
    not a nested runner: with the target as the draft, a prompt's logits equal the target runner's, also
    for a decode after it."""
    target, _ = models
    core = make_core(target, block_size=8, speculative=draft_spec(target))
    runner, pool = core.executor.runner, core.executor.runner.drafter.pool
    tokens = repetitive_prompts(1, length=21)[0]
    want = all_logits(runner, tokens)
    pool.state("x")
    assert pool.reserve("x", len(tokens), {"x"})
    with torch.inference_mode():
        prefill = pool.model.compute_logits(pool.forward(["x"], [tokens[:-1]], [0])).float()
        decode = pool.model.compute_logits(pool.forward(["x"], [tokens[-1:]], [len(tokens) - 1])).float()
    torch.testing.assert_close(prefill[0], want[-2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode[0], want[-1], rtol=1e-4, atol=1e-4)
    pool.finish("x")
    assert len(pool.free) == pool.num_blocks


def test_a_small_draft_pool_evicts_idle_requests_and_stays_exact(models, monkeypatch):
    """A draft pool that holds one request's context at a time: a request drafting now takes the blocks
    of one that is not (which is re-prefilled when it drafts again, with the same drafts), requests
    that find no room draft nothing, and the output is unchanged."""
    from tokenmill.spec_decode import draft_pool

    target, other = models
    monkeypatch.setattr(draft_pool, "DRAFT_CONTEXT_TOKENS", 32)  # 1 x 8 blocks + 1 of 4 tokens: 36 tokens
    spec = draft_spec(other, num_speculative_tokens=2, disable_by_batch_size=1)
    core = make_core(target, block_size=4, speculative=spec)
    proposer = core.executor.runner.drafter
    pool = proposer.pool
    a, b = repetitive_prompts(2, length=30)
    first = propose(proposer, a=(a, 2, 10))
    assert len(first["a"]) == 2 and "a" in pool.states
    assert len(propose(proposer, b=(b, 2, 10))["b"]) == 2
    assert "a" not in pool.states  # evicted: "b" needed its blocks
    assert propose(proposer, a=(a, 2, 10)) == first
    assert propose(proposer, a=(a, 2, 10), b=(b, 2, 10)) == {"a": first["a"]}  # no room for "b" beside "a"
    assert propose(proposer, b=(b, 2, 3)) == {}  # 30 tokens to catch up on for 3 left: not worth it
    proposer.finish("a")
    assert len(pool.free) == pool.num_blocks

    prompts = repetitive_prompts(4, length=16)  # the last to finish drafts alone, within the pool
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 8, 16)]
    plain = run_core(make_core(target, block_size=4), prompts, params)
    assert run_core(core, prompts, params) == plain
    assert core.scheduler.spec_stats.num_drafts > 0
    core.step()
    assert len(pool.free) == pool.num_blocks


def test_seeded_sampling_with_a_draft_model_is_reproducible(models):
    target, other = models
    core = make_core(target, speculative=draft_spec(other))
    seeded = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    prompts = repetitive_prompts(3)
    assert run_core(core, prompts, seeded) == run_core(core, prompts, seeded)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_sampled_drafts_carry_their_distribution(models):
    """A sampling request's drafts are drawn from the draft's own distribution q and verified with
    min(1, p/q): with the target as its own draft q == p, so (nearly) every draft is accepted — as
    point masses they would be accepted only with probability p(d)."""
    target, _ = models
    core = make_core(target, speculative=draft_spec(target, num_speculative_tokens=3))
    sampled = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=30, ignore_eos=True) for i in range(2)]
    run_core(core, repetitive_prompts(2), sampled)
    stats = core.scheduler.spec_stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


def test_draft_model_errors(models, tmp_path):
    target, _ = models
    make_tiny_model("llama-gqa-untied", tmp_path / "big-vocab", vocab_size=512)
    with pytest.raises(ValueError, match="draft's vocabulary \\(512\\) is larger than the target's"):
        make_core(target, speculative=draft_spec(str(tmp_path / "big-vocab")))
    with pytest.raises(ValueError, match="does not run with --tensor-parallel-size > 1"):
        EngineConfig(model=target, speculative=draft_spec(target), parallel=ParallelConfig(tensor_parallel_size=2))
