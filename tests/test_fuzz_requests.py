"""Property-based fuzzing of the two generation endpoints against one real server (Hypothesis, bounded):
whatever the fields hold — right types, wrong types, out-of-range numbers, odd keys, constraints that
cannot be met — the answer is a 200 or a 4xx with an OpenAI-style error, never a 5xx, and afterwards
every KV block is back in the pool."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_server_utils import MODEL, metric_values, model_available, running_server

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a short context bounds every generation; n and the lists are capped small
    yield from running_server(
        tmp_path_factory,
        "fuzz",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "64",
        "--max-n",
        "2",
        "--max-stop",
        "2",
        "--max-logit-bias",
        "4",
        "--log-interval",
        "0",
    )


# ---- values ----------------------------------------------------------------------------------------------

ints = st.one_of(
    st.integers(-3, 40), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30)])
)
# no subnormals: an in-process engine earlier in the session flushes them to zero (torch.set_flush_denormal)
floats = st.one_of(
    st.floats(-3, 3, allow_subnormal=False), st.sampled_from([0.0, 1e-300, 1e300, -1e300, float("inf"), float("nan")])
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
keys = st.one_of(st.integers(-2, 60000).map(str), st.sampled_from(["\u00b2", "\u0663", "1e3", " 7", "", "9" * 50]))
regexes = st.sampled_from(["[a-c]{1,4}", "[^\\s\\S]", "a[^\\s\\S]", "(", "a*", "yes|no", "\\d{2}"])
schemas = st.sampled_from(
    [
        {"type": "object"},
        {"anyOf": [{"$ref": "#"}]},
        {"type": "string", "pattern": "[^\\s\\S]"},
        {"type": "integer", "minimum": 3, "maximum": 1},
        {"enum": []},
        {"type": "bogus"},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    ]
)


def field(valid):
    """Mostly a value of the right kind, sometimes anything."""
    return st.one_of(valid, valid, junk)


SAMPLING = {
    "max_tokens": field(st.one_of(st.integers(0, 6), ints)),
    "n": field(ints),
    "seed": field(ints),
    "temperature": field(floats),
    "top_p": field(floats),
    "top_k": field(ints),
    "min_p": field(floats),
    "presence_penalty": field(floats),
    "frequency_penalty": field(floats),
    "repetition_penalty": field(floats),
    "min_tokens": field(ints),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "stop_token_ids": field(st.lists(ints, max_size=3)),
    "logit_bias": field(st.dictionaries(keys, floats, max_size=5)),
    "priority": field(ints),
    "ignore_eos": field(st.booleans()),
    "prompt_logprobs": field(ints),
    "structured_outputs": field(
        st.one_of(
            st.fixed_dictionaries({"regex": regexes}),
            st.fixed_dictionaries({"json": schemas}),
            st.fixed_dictionaries({"choice": st.lists(st.text(max_size=4), max_size=3)}),
        )
    ),
    "response_format": field(
        st.one_of(
            st.just({"type": "json_object"}),
            schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
        )
    ),
}
COMPLETION = SAMPLING | {
    "prompt": st.one_of(
        st.text(max_size=12),
        st.lists(st.integers(-2, 60000), max_size=6),
        st.lists(st.text(max_size=5), max_size=3),
        junk,
    ),
    "logprobs": field(ints),
    "echo": field(st.booleans()),
}
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
            "content": st.one_of(st.text(max_size=12), junk),
        }
    ),
    max_size=3,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"]), "parameters": schemas}),
        }
    ),
    max_size=2,
)
CHAT = SAMPLING | {
    "messages": st.one_of(messages, junk),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(ints),
    "max_completion_tokens": field(st.one_of(st.integers(0, 6), ints)),
    "tools": field(tools),
    "tool_choice": field(
        st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
    ),
}


def bodies(fields: dict):
    """Request bodies with any subset of `fields`, each field's value from its strategy."""
    return st.fixed_dictionaries({}, optional=fields).map(lambda b: {"model": MODEL, **b})


def check(server, path: str, body: dict, stream: bool) -> None:
    body = dict(body, stream=stream)
    raw = json.dumps(body).encode()  # inf and nan as JSON's non-standard Infinity / NaN: hostile too
    with httpx.stream(
        "POST", f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=120
    ) as r:
        text = r.read().decode(errors="replace")
    assert r.status_code < 500, (path, body, r.status_code, text[:500])
    if r.status_code != 200:
        assert r.json()["error"]["message"], text
    elif stream:
        assert '"internal_server_error"' not in text, (body, text[-500:])


@FUZZ
@given(body=bodies(COMPLETION), stream=st.booleans())
def test_completions_never_answer_5xx(server, body, stream):
    check(server, "/v1/completions", body, stream)


@FUZZ
@given(body=bodies(CHAT), stream=st.booleans())
def test_chat_never_answers_5xx(server, body, stream):
    check(server, "/v1/chat/completions", body, stream)


def test_the_pool_is_whole_after_the_fuzzing(server):
    deadline = time.monotonic() + 30
    while True:
        m = metric_values(server.url)
        if m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"], m
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
