"""A step's token budget bounded in time (`--max-step-ms`), and an abort in the middle of a long
prompt's prefill returning its blocks at the next step boundary."""

from __future__ import annotations

import pytest
from helpers import make_core, make_tiny_model

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.engine.step_budget import MIN_TOKENS, StepBudget
from tokenmill.sampling_params import SamplingParams


def test_the_budget_fits_the_measured_time_per_token_in_the_bound():
    budget = StepBudget(max_step_ms=100, max_tokens=512)
    assert budget.tokens == 512  # nothing measured yet
    budget.observe({"a": 256}, 0.512)  # 2 ms a token: 50 fit in 100 ms
    assert budget.tokens == 50
    budget.observe({"a": 1, "b": 1}, 10.0)  # decodes only: not what the bound is measured on
    assert budget.tokens == 50
    for _ in range(30):  # the machine got quiet: 0.1 ms a token
        budget.observe({"a": 256}, 0.0256)
    assert budget.tokens == 512  # never above max_num_batched_tokens
    for _ in range(30):  # very busy: 1 s a token
        budget.observe({"a": 64}, 64.0)
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


def test_slow_steps_get_smaller_chunks(core):
    core.scheduler.step_budget.max_seconds = 1e-9  # any measured step is too slow: the floor
    try:
        core.add_request(EngineCoreRequest("long", [i % 250 + 1 for i in range(600)], SamplingParams(max_tokens=1)))
        chunks = []
        while core.has_unfinished():
            core.step()
            chunks.append(core.last_schedule.num_scheduled_tokens.get("long"))
    finally:
        core.scheduler.step_budget.max_seconds = 1.0
    assert chunks[0] == 256  # the first step measured the time per token
    assert set(chunks[1:-1]) == {MIN_TOKENS} and sum(chunks) == 600


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
