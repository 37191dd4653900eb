"""Engine core: continuous batching, chunked prefill, preemption, KV pool accounting, seeds."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_core, make_tiny_model, run_core

from tokenmill.engine.core import RequestRejected
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine-model")
    hf = make_tiny_model("llama-gqa-untied", directory)
    return str(directory), hf, load_model(str(directory))


def mixed_workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 400))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 100), ignore_eos=True) for _ in range(n)]
    return prompts, params


def assert_pool_whole(core) -> None:
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not any(m.req_blocks for m in core.kv.managers) and not core.scheduler.running and not core.scheduler.waiting


def assert_matches_alone(hf, prompts, params, batched, alone):
    """Batched greedy output equals the request run alone; a divergence is accepted only where
    the model's top-2 logits tie within 1e-5 (shown with a transformers forward pass)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        a, b = batched[str(i)], alone[i]
        assert len(a) == len(b) == sp.max_tokens
        if a == b:
            continue
        step = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = hf(torch.tensor([p + b[:step]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) <= 1e-5, f"request {i} diverged at step {step} without a tie"


@pytest.fixture(scope="module")
def alone_outputs(tiny):
    directory, _, loaded = tiny
    prompts, params = mixed_workload(64)
    core = make_core(directory, loaded=loaded)
    return [run_core(core, [p], sp)["0"] for p, sp in zip(prompts, params)]


def test_64_mixed_requests_batched_equal_alone(tiny, alone_outputs):
    directory, hf, loaded = tiny
    prompts, params = mixed_workload(64)
    core = make_core(directory, loaded=loaded)
    seen_batch_sizes = []
    batched = run_core(core, prompts, params, on_step=lambda c: seen_batch_sizes.append(len(c.scheduler.running)))
    assert max(seen_batch_sizes) > 8  # it really ran many requests together
    assert_matches_alone(hf, prompts, params, batched, alone_outputs)
    assert_pool_whole(core)


def test_preemption_keeps_outputs(tiny, alone_outputs):
    directory, hf, loaded = tiny
    prompts, params = mixed_workload(64)
    # 40 blocks = 640 tokens: far less than the workload needs at once
    core = make_core(directory, num_blocks=40, loaded=loaded)
    batched = run_core(core, prompts, params)
    assert core.scheduler.num_preemptions >= 5
    assert_matches_alone(hf, prompts, params, batched, alone_outputs)
    assert_pool_whole(core)


def test_chunked_prefill_matches_unchunked(tiny, alone_outputs):
    directory, hf, loaded = tiny
    prompts, params = mixed_workload(64)
    core = make_core(directory, max_num_batched_tokens=32, loaded=loaded)
    chunks = []
    batched = run_core(core, prompts, params, on_step=lambda c: chunks.append(1))
    assert len(chunks) > sum(len(p) for p in prompts) // 32  # prompts really were split
    assert_matches_alone(hf, prompts, params, batched, alone_outputs)
    assert_pool_whole(core)


def test_budget_and_max_num_seqs_respected(tiny):
    directory, _, loaded = tiny
    prompts, params = mixed_workload(20, seed=3)
    core = make_core(directory, max_num_batched_tokens=64, max_num_seqs=4, loaded=loaded)
    steps = []

    def check(c):
        steps.append(c.last_schedule.total_num_scheduled_tokens)
        assert len(c.last_schedule.num_scheduled_tokens) <= 4 and len(c.scheduler.running) <= 4

    run_core(core, prompts, params, on_step=check)
    assert max(steps) == 64 and all(n <= 64 for n in steps)
    assert_pool_whole(core)


def test_abort_mid_generation_returns_blocks(tiny):
    directory, _, loaded = tiny
    prompts, params = mixed_workload(16, seed=5)
    core = make_core(directory, loaded=loaded)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    for _ in range(5):
        core.step()
    assert core.kv.num_free_blocks < core.kv.num_blocks
    core.abort_requests([str(i) for i in range(16)])
    assert_pool_whole(core)


def test_eos_and_stop_token_ids_finish_requests(tiny):
    directory, _, loaded = tiny
    prompts, _ = mixed_workload(4, seed=7)
    greedy = run_core(
        make_core(directory, loaded=loaded), prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    stop_tok = greedy["0"][5]
    core = make_core(directory, loaded=loaded, eos_token_ids={greedy["1"][3]})
    outs = {}
    core.add_request(
        EngineCoreRequest(
            "a", prompts[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True)
        )
    )
    core.add_request(EngineCoreRequest("b", prompts[1], SamplingParams(temperature=0, max_tokens=20)))
    core.add_request(
        EngineCoreRequest("c", prompts[1], SamplingParams(temperature=0, max_tokens=20, min_tokens=10, ignore_eos=True))
    )
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                outs[o.request_id + ":reason"] = o.finish_reason
    first_a = greedy["0"].index(stop_tok)
    assert outs["a"] == greedy["0"][: first_a + 1] and outs["a:reason"] == "stop"
    first_b = greedy["1"].index(greedy["1"][3])
    assert outs["b"] == greedy["1"][: first_b + 1] and outs["b:reason"] == "stop"
    assert len(outs["c"]) == 20 and outs["c:reason"] == "length"
    assert_pool_whole(core)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    directory, _, loaded = tiny
    prompts, _ = mixed_workload(12, seed=9)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = run_core(make_core(directory, loaded=loaded), [prompts[0]], seeded)["0"]
    noise = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 11
    for position in (0, 5, 11):
        params = list(noise)
        params.insert(position, seeded)
        batch = prompts[1:]
        batch.insert(position, prompts[0])
        out = run_core(make_core(directory, loaded=loaded), batch, params)
        assert out[str(position)] == alone
    other = run_core(
        make_core(directory, loaded=loaded),
        [prompts[0]],
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=99, ignore_eos=True),
    )["0"]
    assert other != alone


def test_requests_that_can_never_fit_are_rejected(tiny):
    directory, _, loaded = tiny
    core = make_core(directory, num_blocks=8, loaded=loaded, max_model_len=512)
    with pytest.raises(RequestRejected, match="exceeds the maximum context length of 512"):
        core.add_request(EngineCoreRequest("long", [1] * 500, SamplingParams(max_tokens=20)))
    with pytest.raises(RequestRejected, match="does not fit in the KV cache"):
        core.add_request(EngineCoreRequest("big", [1] * 100, SamplingParams(max_tokens=100)))
    with pytest.raises(RequestRejected, match="at least one token"):
        core.add_request(EngineCoreRequest("empty", [], SamplingParams()))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        core.add_request(EngineCoreRequest("oov", [1, 99999], SamplingParams()))
    core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(RequestRejected, match="already in use"):
        core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=4)))
    while core.has_unfinished():
        core.step()
    assert_pool_whole(core)


def test_max_model_len_auto_and_a_length_the_pool_cannot_hold(tiny):
    """`auto` takes the longest context one sequence's KV fits; an asked length past it is an error
    (raised by `serve` and `LLM` at start) that names the flags to change."""
    directory, _, loaded = tiny
    auto = make_core(directory, num_blocks=8, loaded=loaded, max_model_len="auto")
    assert auto.max_model_len == 8 * 16 and auto.max_model_len_error() is None
    with pytest.raises(RequestRejected, match="exceeds the maximum context length of 128"):
        auto.add_request(EngineCoreRequest("long", [1] * 120, SamplingParams(max_tokens=20)))
    unfit = make_core(directory, num_blocks=8, loaded=loaded, max_model_len=512).max_model_len_error()
    assert "--max-model-len 512 does not fit: the KV cache holds 128 tokens" in unfit
    assert all(flag in unfit for flag in ("--kv-cache-memory", "--num-kv-blocks", "--kv-cache-dtype", "auto"))
    assert make_core(directory, num_blocks=8, loaded=loaded, max_model_len=128).max_model_len_error() is None


def test_a_rejection_names_its_field_and_kind(tiny):
    """The front end maps a rejection to its HTTP error by these fields, never by the message's text."""
    directory, _, loaded = tiny
    core = make_core(directory, num_blocks=8, loaded=loaded, max_model_len=512)
    cases = [
        (EngineCoreRequest("long", [1] * 500, SamplingParams(max_tokens=20)), "prompt", "context_length_exceeded"),
        (EngineCoreRequest("big", [1] * 100, SamplingParams(max_tokens=100)), "prompt", "context_length_exceeded"),
        (EngineCoreRequest("oov", [1, 99999], SamplingParams()), "prompt", "invalid_value"),
        (EngineCoreRequest("bias", [1], SamplingParams(logit_bias={99999: 1.0})), "logit_bias", "invalid_value"),
    ]
    for request, param, code in cases:
        with pytest.raises(RequestRejected) as e:
            core.add_request(request)
        assert (e.value.param, e.value.code) == (param, code), (request.request_id, str(e.value))
    # min_tokens beyond the room the context leaves (max_tokens unset: the engine fills it in)
    short = make_core(directory, num_blocks=8, loaded=loaded, max_model_len=64)
    with pytest.raises(RequestRejected, match=r"min_tokens must be <= max_tokens \(4\), got 20") as e:
        short.add_request(EngineCoreRequest("min", [1] * 60, SamplingParams(max_tokens=None, min_tokens=20)))
    assert (e.value.param, e.value.code) == ("min_tokens", "invalid_value")
    assert not core.has_unfinished() and not short.has_unfinished()
