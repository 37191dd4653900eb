"""Server pieces that need no model: request validation and error shapes, context checks, the
engine-core loop's message handling, per-step output snapshots, and the metrics."""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field

import pytest

from tokenmill.engine.core import EngineStats, RequestRejected
from tokenmill.engine.output_processor import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.outputs import EngineCoreOutput, Logprob
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import core_process
from tokenmill.server.messages import AbortRequests, AddRejected, AddRequest, Shutdown, StepDone
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from tokenmill.server.request_stream import copy_step
from tokenmill.server.serving import ServingContext

# ---- protocol -----------------------------------------------------------------------------------------


def parse_error(model, raw: bytes) -> APIError:
    with pytest.raises(APIError) as e:
        req = parse_body(model, raw)
        req.sampling_params()
    return e.value


@pytest.mark.parametrize(
    "raw,param,words",
    [
        (b"{not json", None, "not valid JSON"),
        (b"   ", None, "empty"),
        (b'"a string"', None, "JSON object"),
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", "max_tokens must be"),
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens", "integer"),
        (b'{"prompt": "x", "temperature": "1"}', "temperature", "number"),
        (b'{"prompt": "x", "echo": 1}', "echo", "boolean"),
        (b'{"prompt": "x", "stop": 3}', "stop", "string or a list of strings"),
        (b'{"prompt": "x", "stop": [""]}', "stop", "non-empty"),
        (b'{"prompt": "x", "seed": 100000000000000000000000}', "seed", "64 bits"),
        (b'{"prompt": "x", "logit_bias": {"a5": 1.0}}', "logit_bias", "token ids"),
        (b'{"prompt": "x", "logit_bias": {"5": 500}}', "logit_bias", "[-100, 100]"),
        (b'{"prompt": "x", "best_of": 3}', "best_of", "not supported"),
        (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage", "boolean"),
        (b'{"prompt": {"a": 1}}', "prompt", "token-id lists"),
        (b'{"max_tokens": 3}', "prompt", "required"),
    ],
)
def test_completion_request_errors_name_the_field(raw, param, words):
    e = parse_error(CompletionRequest, raw)
    assert e.status == 400 and e.param == param and words in e.message, e.to_dict()
    assert set(e.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_null_fields_mean_their_defaults():
    req = parse_body(
        CompletionRequest,
        b'{"prompt": "x", "n": null, "stream": null, "logprobs": null, '
        b'"echo": null, "max_tokens": null, "stop": null, "min_tokens": null}',
    )
    params = req.sampling_params()
    assert (req.n, req.stream, req.echo, params.logprobs, params.min_tokens) == (1, False, False, None, 0)
    assert params.max_tokens is None  # max_tokens is nullable: null is "the room left", as in vLLM
    chat = parse_body(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": "hi"}], "n": null, "logprobs": null, "parallel_tool_calls": null}',
    )
    assert chat.n == 1 and chat.logprobs is False and chat.parallel_tool_calls is True


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"chat_template": "{% for i in range(10**9) %}{% endfor %}"}, "chat_template_kwargs.chat_template"),
        ({"tokenize": True}, "chat_template_kwargs.tokenize"),
        ({"enable_thinking": {"nested": 1}}, "chat_template_kwargs.enable_thinking"),
    ],
)
def test_chat_template_kwargs_are_limited_to_documented_switches(kwargs, param):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}).encode()
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, body).template_kwargs()
    assert e.value.status == 400 and e.value.param == param
    ok = b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}}'
    assert parse_body(ChatCompletionRequest, ok).template_kwargs() == {"enable_thinking": False}


@pytest.mark.parametrize(
    "raw,param,words",
    [
        (b'{"messages": "hi"}', "messages", "array"),
        (
            b'{"messages": [{"role": "user"}], "max_completion_tokens": 0}',
            "max_completion_tokens",
            "max_completion_tokens can be 0 only",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "messages[0].content[0].type",
            "text only",
        ),
        (b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "messages[0].content[0].text", "required"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content", "must be a string or a list"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
            "top_logprobs",
            "top_logprobs must be",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}', "top_logprobs", "requires logprobs"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
            "tools[0].function",
            "required",
        ),
    ],
)
def test_chat_request_errors_name_the_field(raw, param, words):
    e = parse_error(ChatCompletionRequest, raw)
    assert e.status == 400 and e.param == param and words in e.message, e.to_dict()


def test_requests_map_to_sampling_params():
    req = parse_body(
        CompletionRequest,
        b'{"prompt": [1, 2], "n": 2, "temperature": 0, "top_k": -1, "seed": 3, '
        b'"stop": "x", "logprobs": 2, "user": "u", "unknown_field": 1}',
    )
    p = req.sampling_params()
    assert (p.n, p.temperature, p.top_k, p.seed, p.stop, p.logprobs, p.max_tokens) == (2, 0.0, 0, 3, ["x"], 2, 16)
    chat = parse_body(
        ChatCompletionRequest,
        b'{"messages": [{"role": "developer", "content": [{"type": "text", '
        b'"text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 5, '
        b'"max_completion_tokens": 7, "logprobs": true}',
    )
    p = chat.sampling_params()
    assert p.max_tokens == 7 and p.logprobs == 0
    assert chat.chat_messages() == [{"role": "system", "content": "ab"}]
    assert (
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}')
        .sampling_params()
        .max_tokens
        is None
    )


def _ctx(max_model_len=100, capacity=80) -> ServingContext:
    return ServingContext(
        client=None,
        tokenizer=None,
        model_names=["m", "alias"],
        max_model_len=max_model_len,
        capacity_tokens=capacity,
        vocab_size=1000,
    )


def test_context_checks():
    ctx = _ctx()
    assert ctx.check_model(None) == "m" and ctx.check_model("alias") == "alias"
    with pytest.raises(APIError) as e:
        ctx.check_model("other")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    assert ctx.fit_to_context(30, SamplingParams(max_tokens=None), "prompt").max_tokens == 50  # KV-limited
    assert ctx.fit_to_context(30, SamplingParams(max_tokens=50), "prompt").max_tokens == 50
    for n, max_tokens, param in [(0, 5, "prompt"), (80, None, "prompt"), (30, 51, "max_tokens")]:
        with pytest.raises(APIError) as e:
            ctx.fit_to_context(n, SamplingParams(max_tokens=max_tokens), "prompt")
        assert e.value.param == param and e.value.status == 400
    with pytest.raises(APIError) as e:
        ctx.check_token_ids([1, 1000], "prompt")
    assert "vocabulary" in e.value.message


# ---- engine-core loop ---------------------------------------------------------------------------------


class FakeKV:
    num_free_blocks, num_blocks = 10, 10


@dataclass
class FakeCore:
    """Enough of EngineCore for the process loop: one step finishes every request."""

    kv: FakeKV = field(default_factory=FakeKV)
    pending: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    def add_request(self, request):
        rid = request.request_id
        if rid == "too-long":
            raise RequestRejected("prompt too long")
        if rid == "broken":
            raise RuntimeError("boom")
        self.pending.append(rid)

    def abort_requests(self, ids):
        self.aborted += ids
        self.pending = [r for r in self.pending if r not in ids]

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        outs = [
            EngineCoreOutput(request_id=r, new_token_ids=[7], timestamp=1.0, finish_reason="length")
            for r in self.pending
        ]
        self.pending = []
        return outs

    def stats(self, fresh=True):
        return EngineStats(len(self.pending), 0, 0.0, 0, prefix_cache_queries=5, prefix_cache_hits=2)


def test_core_loop_handles_adds_rejections_aborts_and_shutdown():
    inputs, outputs = queue.Queue(), queue.Queue()
    params = SamplingParams()
    for rid in ("a", "too-long", "broken", "b"):
        inputs.put(AddRequest(EngineCoreRequest(rid, [1, 2], params, 0.0)))
    inputs.put(AbortRequests(["b"]))
    core = FakeCore()
    inputs.put(Shutdown())
    core_process._loop(core, inputs, outputs)
    messages = []
    while not outputs.empty():
        messages.append(outputs.get())
    rejected = {m.request_id: m.message for m in messages if isinstance(m, AddRejected)}
    # a bug in add_request is logged, not forwarded (no exception names or internals to the client)
    assert rejected == {
        "too-long": "prompt too long",
        "broken": "the engine could not accept this request (see the server log)",
    }
    # shutdown came in the same drain as the adds: the loop stops before stepping
    assert not [m for m in messages if isinstance(m, StepDone)]
    assert core.aborted == ["broken", "b"]


def test_core_loop_steps_and_reports_stats():
    inputs, outputs = queue.Queue(), queue.Queue()
    core = FakeCore()
    inputs.put(AddRequest(EngineCoreRequest("a", [1], SamplingParams(), 0.0, cache_salt="salt")))
    real_drain = core_process._drain
    calls = []

    def drain(q, block):  # after the first step, ask the loop to stop
        calls.append(block)
        return real_drain(q, False) if len(calls) == 1 else [Shutdown()]

    core_process._drain, saved = drain, core_process._drain
    try:
        core_process._loop(core, inputs, outputs)
    finally:
        core_process._drain = saved
    message = outputs.get()
    outs, stats = message.outputs, message.stats
    assert isinstance(message, StepDone) and [o.request_id for o in outs] == ["a"]
    assert stats["num_received"] == 1 and stats["prefix_cache_queries"] == 5 and stats["prefix_cache_hits"] == 2
    assert stats["num_blocks"] == 10


# ---- output snapshots and metrics ---------------------------------------------------------------------


def _result(finished: bool, deltas: list[int], times: list[float]) -> RequestOutput:
    out = CompletionOutput(
        0,
        text="ab",
        token_ids=[1, 2],
        delta_text="b",
        delta_token_ids=deltas,
        finish_reason="length" if finished else None,
        delta_logprobs=[{2: Logprob(-0.5, 1)}],
    )
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        token_times=times,
        finished_time=times[-1] if finished else None,
    )
    return RequestOutput("r", None, [5, 6, 7], [out], metrics, num_cached_tokens=2, finished=finished)


def testcopy_step_snapshots_deltas_and_reports_finish_once():
    reported: set[int] = set()
    result = _result(True, [2], [11.0, 12.0])
    snap = copy_step(result, reported)
    result.outputs[0].delta_token_ids.append(99)  # the processor reuses its objects
    assert snap.deltas[0].token_ids == [2] and snap.deltas[0].finish_reason == "length" and snap.finished
    result.outputs[0].delta_token_ids, result.outputs[0].delta_text = [], ""
    assert copy_step(result, reported).deltas == []


def test_metrics_observe_engine_timestamps():
    m = ServerMetrics("m", log_requests=False)
    m.on_outputs([_result(False, [1], [11.0])])
    m.on_outputs([_result(True, [2, 3], [11.0, 11.5, 12.0])])
    m.on_stats(
        {
            "num_running": 0,
            "num_waiting": 0,
            "kv_cache_usage": 0.25,
            "num_preemptions": 2,
            "num_free_blocks": 3,
            "num_blocks": 4,
            "prefix_cache_queries": 3,
            "prefix_cache_hits": 1,
        }
    )
    m.on_stats({"num_preemptions": 3, "prefix_cache_queries": 6, "prefix_cache_hits": 2, "decode_steps": 4})
    m.on_stats({"num_preemptions": 3, "prefix_cache_queries": 6, "prefix_cache_hits": 2, "decode_steps": 9})

    def value(name, **labels):
        return m.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("tokenmill:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value("tokenmill:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value("tokenmill:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value("tokenmill:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value("tokenmill:request_decode_time_seconds_sum") == pytest.approx(1.0)
    assert value("tokenmill:time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert value("tokenmill:inter_token_latency_seconds_count") == 2
    assert value("tokenmill:prompt_tokens_total") == 3
    assert value("tokenmill:generation_tokens_total") == 3
    assert value("tokenmill:num_preemptions_total") == 3
    assert value("tokenmill:prefix_cache_queries_total") == 6 and value("tokenmill:prefix_cache_hits_total") == 2
    assert value("tokenmill:engine_decode_steps_total") == 9 and value("tokenmill:engine_prompt_steps_total") == 0
    assert value("tokenmill:request_success_total", finished_reason="length") == 1
    assert value("tokenmill:kv_cache_usage_perc") == 0  # the last snapshot had no usage
    other = ServerMetrics("m")  # a private registry per app: no duplicate-metric errors
    assert other.registry is not m.registry


def test_undelivered_steps_merge_so_a_slow_reader_holds_one_output():
    import asyncio
    from types import SimpleNamespace

    from tokenmill.server.request_stream import EngineDeadError, RequestStream, SampleDelta, StreamOutput

    async def read(steps, error=None):
        stream = RequestStream(SimpleNamespace(_streams={}, abort=lambda rid: None), "r")
        for i, (index, text, finish) in enumerate(steps):
            stream.put(
                StreamOutput("r", [1], 0, [SampleDelta(index, text, [i], [{}], finish, None)], finish is not None, [])
            )
        if error is not None:
            stream.put(error)
        assert len(stream._pending) == 1 + (error is not None)
        items = []
        try:
            async for item in stream:
                items.append(item)
        except EngineDeadError as e:
            items.append(e)
        return items

    items = asyncio.run(read([(0, "a", None), (1, "x", None), (0, "b", None), (0, "c", "stop")]))
    assert len(items) == 1 and items[0].finished
    first, second = items[0].deltas
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (0, "abc", [0, 2, 3], "stop")
    assert len(first.logprobs) == 3 and (second.index, second.text) == (1, "x")
    items = asyncio.run(read([(0, "a", None), (0, "b", None)], EngineDeadError("gone")))
    assert items[0].deltas[0].text == "ab" and isinstance(items[1], EngineDeadError)  # output first, then the error


def test_engine_failures_become_the_right_errors():
    from tokenmill.server.request_stream import RequestFailed, failure_of
    from tokenmill.server.serving import engine_error

    result = _result(True, [], [11.0])
    assert failure_of(result) is None
    result.outputs[0].error, result.outputs[0].error_param = "cannot compile the regex constraint", "structured_output"
    rejected = failure_of(result)
    assert isinstance(rejected, RequestRejected)
    e = engine_error(rejected, "guided_regex")  # the client's field, not the engine's name for it
    assert e.status == 400 and e.param == "guided_regex" and "regex" in e.message
    result.outputs[0].error_param = None
    failed = failure_of(result)
    assert isinstance(failed, RequestFailed) and engine_error(failed).status == 500


def test_the_start_up_log_says_whose_kv_bytes_it_counts():
    """The pool is sized from the driver's specs: one rank's heads or stripe under tensor or context
    parallelism, every stage's layers (of one tensor-parallel rank) under pipeline parallelism."""
    from tokenmill.config import ParallelConfig

    def scope(**sizes) -> str:
        return core_process.kv_cache_scope(ParallelConfig(**sizes))

    assert scope() == ""
    assert scope(tensor_parallel_size=2) == " per rank, 2 ranks"
    assert scope(decode_context_parallel_size=2, prefill_context_parallel_size=2) == " per rank, 2 ranks"
    assert scope(pipeline_parallel_size=2) == " over 2 pipeline stages"
    assert scope(tensor_parallel_size=2, pipeline_parallel_size=3) == " per tensor-parallel rank over 3 pipeline stages"


@pytest.mark.parametrize("name", ["", "a\nb", "x" * 257, "tab\there"])
def test_lora_names_that_requests_could_not_give_are_refused(name):
    from tokenmill.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    for model, extra in ((LoadLoRAAdapterRequest, {"lora_path": "/x"}), (UnloadLoRAAdapterRequest, {})):
        e = parse_error(model, json.dumps({"lora_name": name, **extra}).encode())
        assert e.status == 400 and e.param == "lora_name", e.to_dict()


@pytest.mark.parametrize(
    "extra, param",
    [({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True, "logprobs": 1}, "echo")],
)
def test_prompt_logprobs_cannot_come_with_a_kv_transfer(extra, param):
    """The disaggregation proxy sends kv_transfer_params: the decode server takes the prompt's KV and never
    computes its logits, so the prompt's logprobs came back as nulls (or a 500 with echo)."""
    body = {"prompt": "Hi", "kv_transfer_params": {"transfer_id": "t1"}, **extra}
    req = parse_body(CompletionRequest, json.dumps(body).encode())
    with pytest.raises(APIError) as e:
        req.sampling_params()
    assert e.value.status == 400 and e.value.param == param and "kv_transfer_params" in e.value.message


@pytest.mark.parametrize("transfer_id", ["", 7, ["t"], "x" * 257])
def test_a_transfer_id_is_a_short_string(transfer_id):
    """The decode server asks the producer for it (a store key) until it comes: no huge or odd ones."""
    body = {"prompt": "Hi", "kv_transfer_params": {"transfer_id": transfer_id}}
    req = parse_body(CompletionRequest, json.dumps(body).encode())
    with pytest.raises(APIError) as e:
        req.sampling_params()
    assert e.value.status == 400 and e.value.param == "kv_transfer_params" and "transfer_id" in e.value.message
    ok = parse_body(CompletionRequest, json.dumps({**body, "kv_transfer_params": {"transfer_id": "x" * 256}}).encode())
    assert ok.sampling_params().kv_transfer_id == "x" * 256


def test_responses_and_messages_take_priority_as_chat_does():
    from tokenmill.server.protocol_anthropic import MessagesRequest
    from tokenmill.server.protocol_responses import ResponsesRequest

    responses = parse_body(ResponsesRequest, b'{"input": "Hi", "priority": -3}')
    assert responses.chat_request(responses.input_messages()).priority == -3
    messages = parse_body(
        MessagesRequest, b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "priority": 7}'
    )
    assert messages.chat_request(None).priority == 7
    for model, body in (
        (ResponsesRequest, b'{"input": "Hi", "priority": 1180591620717411303424}'),
        (MessagesRequest, b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "priority": "high"}'),
    ):
        e = parse_error(model, body)
        assert e.status == 400 and e.param == "priority", e.to_dict()
