"""Every edge of a request that could fail later, found where the request comes in (no server):
numbers by the range their consumer accepts, logit_bias keys by int parsing, bodies every HTTP
front refuses the same way, and output constraints no output can satisfy."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.output_processor import child_params
from tokenmill.http_front import MAX_JSON_DEPTH, APIError, parse_json_object
from tokenmill.sampling_params import SEED_END, SEED_MIN, SamplingParams
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def test_seed_range_is_what_the_generator_accepts():
    torch.Generator().manual_seed(SEED_MIN)
    torch.Generator().manual_seed(SEED_END - 1)
    for outside in (SEED_MIN - 1, SEED_END):
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(outside)


@pytest.mark.parametrize("seed,n", [(SEED_END - 2, 2), (SEED_END - 1, 1), (SEED_MIN, 4), (-1, 3)])
def test_every_sample_of_an_accepted_seed_gets_a_generator(seed, n):
    params = SamplingParams(seed=seed, n=n)
    for i in range(n):
        torch.Generator().manual_seed(child_params(params, i).seed)


@pytest.mark.parametrize("seed,n", [(SEED_END - 1, 2), (SEED_END - 3, 4), (SEED_END, 1), (SEED_MIN - 1, 1)])
def test_a_seed_whose_samples_overflow_is_refused(seed, n):
    with pytest.raises(ValueError, match=r"^seed must fit in 64 bits"):
        SamplingParams(seed=seed, n=n)


def _error(model, body: bytes) -> APIError:
    with pytest.raises(APIError) as e:
        parse_body(model, body).sampling_params()
    return e.value


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("seed", 2**64 - 1, "seed"),  # with n = 2: the second sample's seed is 2**64
        ("logit_bias", {"\u00b2": 1}, "logit_bias"),  # "²".isdigit() is True, int("²") fails
        ("logit_bias", {"\u0663": 1}, "logit_bias"),  # an Arabic-Indic three: int() takes it, ids are ASCII
        ("logit_bias", {"-1": 1}, "logit_bias"),
        ("logit_bias", {"1e3": 1}, "logit_bias"),
        ("logit_bias", {"9" * 5000: 1}, "logit_bias"),  # past int()'s digit limit
        ("logit_bias", {"5": 1e999}, "logit_bias"),  # JSON's 1e999 is inf
        ("temperature", 1e999, "temperature"),
        ("temperature", -0.5, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("min_p", 2, "min_p"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -1e999, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("n", 0, "n"),
        ("max_tokens", -1, "max_tokens"),
        ("min_tokens", -1, "min_tokens"),
        ("logprobs", 21, "logprobs"),
        ("logprobs", -1, "logprobs"),
        ("prompt_logprobs", 10**30, "prompt_logprobs"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("stop", [""], "stop"),
        ("priority", 2**63, "priority"),
    ],
)
def test_completion_numbers_out_of_range_are_a_400_naming_the_field(field, value, param):
    import json

    body = {"prompt": "x", "n": 2 if field == "seed" else 1, field: value}
    e = _error(CompletionRequest, json.dumps(body).replace("Infinity", "1e999").encode())
    assert e.status == 400 and e.param == param, e.to_dict()


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("top_logprobs", 21, "top_logprobs"),
        ("top_logprobs", -1, "top_logprobs"),
        ("max_completion_tokens", -5, "max_completion_tokens"),
        ("max_reasoning_tokens", -1, "max_reasoning_tokens"),
        ("logit_bias", {"\u00b2": 1}, "logit_bias"),
    ],
)
def test_chat_numbers_out_of_range_are_a_400_naming_the_field(field, value, param):
    import json

    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, field: value}
    e = _error(ChatCompletionRequest, json.dumps(body).encode())
    assert e.status == 400 and e.param == param, e.to_dict()


def test_logit_bias_keys_are_decimal_token_ids():
    req = parse_body(CompletionRequest, b'{"prompt": "x", "logit_bias": {"12": 5, "0": -100}}')
    assert req.sampling_params().logit_bias == {12: 5, 0: -100}


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"text"', "JSON object"),
        (b"[" * 100_000, "not valid JSON"),
        (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nested deeper"),
    ],
)
def test_bodies_every_front_refuses(raw, words):
    with pytest.raises(APIError) as e:
        parse_json_object(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json" and words in e.value.message


def test_a_body_at_the_depth_limit_is_taken():
    raw = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert isinstance(parse_json_object(raw)["a"], list)


# ---- constraints no output can satisfy ----------------------------------------------------------


def _manager():
    from tokenmill.structured.backend import TokenizerData
    from tokenmill.structured.manager import StructuredOutputManager

    vocab = [b"a", b"b", b"{", b"}", b'"', b":", b"1", b"</s>"]
    return StructuredOutputManager(TokenizerData(None, len(vocab), [7], vocab), len(vocab), compile_timeout=30)


def _state(manager, spec):
    state = manager.new_state(spec, None, {7})
    state.future.result(timeout=60)
    return state


@pytest.mark.parametrize(
    "spec",
    [
        ("regex", "[^\\s\\S]"),
        ("json", {"anyOf": [{"$ref": "#"}]}),
        ("json", {"allOf": [{"$ref": "#"}]}),
    ],
)
def test_an_empty_language_is_refused_when_the_request_starts(spec):
    from tokenmill.structured.spec import StructuredOutputSpec

    manager = _manager()
    try:
        kind, value = spec
        spec = StructuredOutputSpec.json(value) if kind == "json" else StructuredOutputSpec(kind, value)
        state = _state(manager, spec)
        error = state.start()
        assert error is not None and "matches no output" in error
    finally:
        manager.shutdown()


def test_a_dead_end_after_some_tokens_names_the_constraint():
    from tokenmill.structured.manager import ConstraintDeadEnd, grammar_failure
    from tokenmill.structured.spec import StructuredOutputSpec

    manager = _manager()
    try:
        state = _state(manager, StructuredOutputSpec("regex", "a[^\\s\\S]"))
        assert state.start() is None  # "a" can start it
        manager.bitmask([state])
        assert state.accept(0)  # "a"
        with pytest.raises(ConstraintDeadEnd) as e:
            manager.bitmask([state])
        message, param = grammar_failure(e.value)
        assert param == "structured_output" and "cannot be continued" in message
        assert grammar_failure(RuntimeError("boom")) == ("the structured-output grammar failed", None)
    finally:
        manager.shutdown()
