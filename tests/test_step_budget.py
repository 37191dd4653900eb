"""A step's token budget bounded in time (`--max-step-ms`), the steps counted by kind, and an abort in
the middle of a long prompt's prefill returning its blocks at the next step boundary."""

from __future__ import annotations

import pytest
from helpers import make_core, make_tiny_model

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.engine.step_budget import MIN_TOKENS, StepBudget
from tokenmill.sampling_params import SamplingParams


def _steps(budget: StepBudget, fixed: float, per_token: float, sizes=(4, 256), times: int = 40) -> None:
    for i in range(times):
        n = sizes[i % len(sizes)]
        budget.observe({"a": n}, fixed + per_token * n)


def test_the_budget_fits_the_measured_step_time_in_the_bound():
    budget = StepBudget(max_step_ms=200, max_tokens=512)
    assert budget.tokens == 512  # nothing measured yet
    _steps(budget, fixed=0.05, per_token=0.002)  # decode steps and prefill chunks
    fixed, per_token = budget.fit()
    assert fixed == pytest.approx(0.05) and per_token == pytest.approx(0.002)
    assert budget.tokens in (74, 75)  # (200 - 50) ms / 2 ms, rounded down
    _steps(budget, fixed=0.01, per_token=0.0001)  # the machine got quiet
    assert budget.tokens == 512  # never above max_num_batched_tokens
    _steps(budget, fixed=0.5, per_token=0.002)  # the fixed part alone is over the bound
    assert budget.tokens in (249, 250)  # chunks no smaller than where the tokens' time equals the fixed part
    _steps(budget, fixed=0.0, per_token=1.0)  # very busy
    assert budget.tokens == MIN_TOKENS  # every step still makes progress


def test_zero_turns_the_bound_off():
    budget = StepBudget(max_step_ms=0, max_tokens=512)
    budget.observe({"a": 256}, 100.0)
    assert budget.tokens == 512


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("budget-model"))
    make_tiny_model("llama-gqa-untied", directory)
    return make_core(directory, max_num_batched_tokens=256)


def test_prefill_chunks_are_the_budget(core):
    core.scheduler.step_budget.max_seconds = 1e-9  # every step is too slow: the smallest chunks the fit allows
    try:
        core.add_request(EngineCoreRequest("long", [i % 250 + 1 for i in range(600)], SamplingParams(max_tokens=1)))
        chunks, budgets = [], []
        while core.has_unfinished():
            budgets.append(core.scheduler.step_budget.tokens)
            core.step()
            chunks.append(core.last_schedule.num_scheduled_tokens.get("long"))
    finally:
        core.scheduler.step_budget.max_seconds = 1.0
    assert chunks[0] == 256 and sum(chunks) == 600  # nothing measured before the first step
    assert all(c == min(b, 600 - sum(chunks[:i])) for i, (c, b) in enumerate(zip(chunks, budgets)))


def test_an_abort_mid_prefill_returns_the_blocks_at_the_next_step_boundary(core):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("long", [i % 250 + 1 for i in range(900)], params))
    core.add_request(EngineCoreRequest("short", [1, 2, 3], params))
    core.step()  # the first chunk of the long prompt
    assert core.requests["long"].num_computed_tokens < 900
    used = core.kv.num_blocks - core.kv.num_free_blocks
    core.abort_requests(["long"])  # between steps: where the core process takes an abort
    assert core.kv.num_blocks - core.kv.num_free_blocks < used - 10  # its blocks are back
    out = []
    while core.has_unfinished():
        out += [t for o in core.step() for t in o.new_token_ids]
    assert len(out) == 4 and core.kv.num_free_blocks == core.kv.num_blocks


def test_the_steps_are_counted_by_kind(core):
    """Prompt steps carry the prompt's tokens (and the decodes beside them), decode steps one token a request."""

    def counts():
        s = core.stats().steps
        return {k: getattr(s, k) for k in ("decode_steps", "decode_step_tokens", "prompt_steps", "prompt_step_tokens")}

    before = counts()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("alone", [i * 7 % 249 + 1 for i in range(513)], params))  # not cached
    prompt_steps = 0
    while core.has_unfinished():
        prompt_steps += core.requests["alone"].num_computed_tokens < 513
        core.step()
    mid = counts()
    # the first token comes from the prompt's last chunk; three decode steps give the other three
    # chunks of at most 256: the last one a single token, still the prompt's
    assert mid["prompt_steps"] - before["prompt_steps"] == prompt_steps >= 3
    assert mid["prompt_step_tokens"] - before["prompt_step_tokens"] == 513
    assert (mid["decode_steps"] - before["decode_steps"], mid["decode_step_tokens"] - before["decode_step_tokens"]) == (
        3,
        3,
    )
    # a prompt arriving while another request decodes: their shared step is a prompt step with its decode
    core.add_request(EngineCoreRequest("first", [5, 6, 7], params))
    core.step()  # its prompt
    core.add_request(EngineCoreRequest("second", [8, 9, 10, 11], params))
    while core.has_unfinished():
        core.step()
    end = counts()
    assert end["prompt_steps"] - mid["prompt_steps"] == 2
    assert end["prompt_step_tokens"] - mid["prompt_step_tokens"] == 3 + 4 + 1
    assert end["decode_step_tokens"] - mid["decode_step_tokens"] == 2 * 3 - 1
    assert core.scheduler.step_times.decode_step_seconds > 0 and core.scheduler.step_times.prompt_step_seconds > 0
