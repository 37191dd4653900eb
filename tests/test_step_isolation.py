"""One request that makes a step raise fails alone: the core retries the step's requests in halves
(`EngineCore._fail_step`), finishes only the one at fault, and the others — in the failed step or
not, seeded or greedy, mid-prompt or mid-output — finish with exactly the tokens they get alone.

Each failure is provoked in the real engine by breaking an admitted request behind validation's back
(as a validation gap would let through): a bad token id in its prompt (the forward pass raises), an
out-of-vocabulary logit bias (sampling raises), a seed the generator refuses (building its runner
state raises), a broken grammar state (the structured-output step raises)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import make_core, make_tiny_model

from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputSpec
from tokenmill.structured.backend import TokenizerData

VOCAB = 256
REGEX = StructuredOutputSpec.regex("[a-z]{4,24}")

# request id -> (prompt, params, steps to run before it is added): prefills and decodes of all kinds
INNOCENT = {
    "short": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), 0),
    "long": (list(range(1, 100)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0),
    "seeded": ([9, 8, 7, 6], SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True), 0),
    "constrained": ([3, 4], SamplingParams(temperature=0, max_tokens=16, structured_output=REGEX), 0),
    "late": (list(range(40, 90)), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), 3),
}


def _bad_prompt_token(request) -> None:
    request.prompt_token_ids[1] = VOCAB + 7  # the embedding lookup raises


def _bad_logit_bias(request) -> None:
    object.__setattr__(request.params, "logit_bias", {-VOCAB - 7: 1.0})  # the sampler raises


def _bad_seed(request) -> None:
    object.__setattr__(request.params, "seed", 2**70)  # the runner's generator raises


def _broken_grammar(request) -> None:
    request.structured.matcher = object()  # the structured-output step raises on it


FAULTS = {
    "forward": (_bad_prompt_token, SamplingParams(temperature=0, max_tokens=8)),
    "sampling": (_bad_logit_bias, SamplingParams(temperature=0, max_tokens=8)),
    "runner-state": (_bad_seed, SamplingParams(temperature=0.5, seed=1, max_tokens=8)),
    "grammar": (_broken_grammar, SamplingParams(temperature=0, max_tokens=8, structured_output=REGEX)),
}


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> EngineCore:
    """One core for the module, with structured output over a byte vocabulary (token i is byte i)."""
    directory = str(tmp_path_factory.mktemp("isolation-model"))
    make_tiny_model("llama-gqa-untied", directory)
    data = TokenizerData(None, VOCAB, [], [bytes([i]) for i in range(VOCAB)])
    return make_core(directory, max_num_batched_tokens=64, tokenizer_data=data)


def _run(core: EngineCore, names, fault=None) -> dict:
    """Run the innocents named (each added after its number of steps), and the faulty request if
    given; returns each request's tokens and, for a request that failed, its error."""
    out, errors, step = {}, {}, 0
    pending = {name: INNOCENT[name] for name in names}
    if fault is not None:
        breaks, params = FAULTS[fault]
        pending["culprit"] = ([1, 2, 3, 4, 5], params, 1)
    while pending or core.has_unfinished():
        for rid, (prompt, params, after) in list(pending.items()):
            if after <= step:
                core.add_request(EngineCoreRequest(rid, list(prompt), params))
                if rid == "culprit":
                    if (state := core.requests[rid].structured) is not None and state.future is not None:
                        state.future.result(timeout=60)  # compiled, so that breaking it sticks
                    breaks(core.requests[rid])
                out[rid] = []
                del pending[rid]
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
        step += 1
    return out, errors


@pytest.fixture(scope="module")
def alone(core):
    return {name: _run(core, [name])[0][name] for name in INNOCENT}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_faulty_request_fails_alone_and_the_others_keep_their_tokens(core, alone, fault):
    before = core.stats()
    out, errors = _run(core, INNOCENT, fault)
    assert set(errors) == {"culprit"}, errors
    assert out["culprit"] == []
    for name in INNOCENT:
        assert out[name] == alone[name], name
    stats = core.stats()
    if fault == "grammar":  # the core takes a failing grammar out of the step before it runs
        assert "grammar" in errors["culprit"]
    else:
        assert "failed a step on its own" in errors["culprit"]
        assert stats.step_failures - before.step_failures >= 2
        assert stats.requests_failed_isolated - before.requests_failed_isolated == 1
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.suspects
    core.step()  # tells the runner of the last finished requests
    assert core.executor.runner.requests == {}  # it holds no stale state


def test_a_step_that_fails_for_no_one_request_fails_no_one(core, alone):
    """A step that raises once (a transient fault) is retried in halves that all run: nobody fails."""
    runner, failed, before = core.executor.runner, [], core.stats()
    execute = runner.execute

    def once(sched, *args):
        if len(sched.num_scheduled_tokens) > 1 and not failed:
            failed.append(sched)
            raise RuntimeError("transient")
        return execute(sched, *args)

    runner.execute = once
    try:
        out, errors = _run(core, ["short", "long", "seeded"])
    finally:
        del runner.execute
    assert failed and not errors
    assert all(out[name] == alone[name] for name in ("short", "long", "seeded"))
    stats = core.stats()
    assert stats.step_failures - before.step_failures == 1
    assert stats.requests_failed_isolated == before.requests_failed_isolated


def test_the_failures_are_counted_in_metrics(core):
    from tokenmill.server.metrics import ServerMetrics

    stats = core.stats()
    assert stats.step_failures and stats.requests_failed_isolated  # from the tests above
    metrics = ServerMetrics("tiny", log_requests=False)
    metrics.on_stats(dataclasses.asdict(stats))
    text = metrics.render().decode()
    assert f'tokenmill:step_failures_total{{model_name="tiny"}} {float(stats.step_failures)}' in text
    assert (
        f'tokenmill:requests_failed_isolated_total{{model_name="tiny"}} {float(stats.requests_failed_isolated)}' in text
    )
