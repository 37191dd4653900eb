"""Hostile requests against one real server and the two fronts in front of it (`router`,
`disagg-proxy`): a request whose parameters cannot run is a 4xx naming the field — before any step
starts with it, or, for a constraint that dead-ends mid-output, as the request's own 400 (in a
stream too) — while a concurrent innocent request completes with the tokens it gets alone; and every
front answers a hostile body with the server's JSON 400 / 413, never a 5xx."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest
from test_disaggregated import ProxyProcess
from test_router import RouterProcess, wait_for
from test_server_utils import MODEL, healthy, metric_values, model_available, running_server, sse_events

from tokenmill.sampling_params import SEED_END

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

INNOCENT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
DEAD = "[^\\s\\S]"  # a character class nothing matches: a regex (or JSON pattern) with an empty language


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(
        tmp_path_factory, "hostile", "--num-kv-blocks", "128", "--max-model-len", "512", "--log-interval", "0"
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def alone(client) -> str:
    """The innocent request's greedy text when it runs by itself."""
    return client.completions.create(**INNOCENT).choices[0].text


def pool_whole(url: str) -> bool:
    m = metric_values(url)
    return m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"]


def beside_innocent(client, hostile):
    """Run `hostile()` while the innocent request runs; return (its result or exception, the innocent text)."""

    def attempt():
        try:
            return hostile()
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(lambda: client.completions.create(**INNOCENT).choices[0].text)
        time.sleep(0.05)
        result = pool.submit(attempt).result()
        return result, innocent.result()


def assert_bad_request(result, param: str, words: str = "") -> None:
    assert isinstance(result, openai.BadRequestError), result
    error = result.body  # the client's body is the "error" object
    assert error["param"] == param and words in error["message"], error


# ---- parameters that cannot run ------------------------------------------------------------------------


def test_a_seed_that_overflows_with_n_is_a_400_and_the_innocent_request_is_untouched(client, server, alone):
    result, innocent = beside_innocent(
        client,
        lambda: client.completions.create(**dict(INNOCENT, prompt="Hello", n=2, seed=SEED_END - 1, temperature=1.0)),
    )
    assert_bad_request(result, "seed", "64 bits")
    assert innocent == alone
    # the last seed that fits: both samples get a generator in the same step as the innocent request
    edge, innocent = beside_innocent(
        client,
        lambda: client.completions.create(**dict(INNOCENT, prompt="Hello", n=2, seed=SEED_END - 2, temperature=1.0)),
    )
    assert len(edge.choices) == 2 and innocent == alone
    assert pool_whole(server.url)


@pytest.mark.parametrize("bias", [{"\u00b2": 1}, {"-3": 1}, {"12a": 1}, {"9" * 5000: 1}])
def test_logit_bias_keys_that_are_not_token_ids_are_a_400(client, bias):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**INNOCENT, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias", e.value.body


# ---- constraints no output can satisfy ---------------------------------------------------------------


def test_an_empty_regex_is_refused_before_it_runs(client, server, alone):
    result, innocent = beside_innocent(
        client, lambda: client.completions.create(**INNOCENT, extra_body={"structured_outputs": {"regex": DEAD}})
    )
    assert_bad_request(result, "structured_outputs.regex", "matches no output")
    assert innocent == alone


def test_a_schema_that_is_only_a_ref_to_itself_is_refused(client):
    schema = {"anyOf": [{"$ref": "#"}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}},
        )
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body


DEAD_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "pattern": DEAD}},
                "required": ["key"],
            },
        },
    }
]
DEAD_TOOL_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Look it up"}],
    "max_tokens": 40,
    "temperature": 0,
    "tools": DEAD_TOOL,
    "tool_choice": "required",
}


def test_a_tool_whose_arguments_dead_end_is_a_400_naming_tools(client, server, alone):
    """The call's opening tokens are allowed; the argument string can never start: a dead end mid-way."""
    result, innocent = beside_innocent(client, lambda: client.chat.completions.create(**DEAD_TOOL_CHAT))
    assert_bad_request(result, "tools", "cannot be continued")
    assert innocent == alone
    assert pool_whole(server.url)


def test_a_streamed_dead_end_ends_with_the_same_error(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=dict(DEAD_TOOL_CHAT, stream=True), timeout=60
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "tools" and error["code"] == "invalid_value" and "cannot be continued" in error["message"]


# ---- the fronts ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fronts(server, tmp_path_factory):
    """{"server", "router", "proxy"} -> URL: the router and the proxy both in front of the one server."""
    log_dir = tmp_path_factory.mktemp("fronts")
    router = RouterProcess(log_dir, [server.url], "--health-interval", "1").start()
    proxy = ProxyProcess(server.url, server.url, log_dir)
    try:
        wait_for(lambda: healthy(proxy.url), 60, proxy.log)
        yield {"server": server.url, "router": router.url, "proxy": proxy.url}
    finally:
        proxy.proc.terminate()
        proxy.proc.wait(10)
        assert router.stop() == 0, router.log()


HOSTILE_BODIES = {
    "deeply nested": (b'{"prompt": ' * 100_000, "application/json"),
    "deep inside a field": (
        b'{"prompt": "x", "kv_transfer_params": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "application/json",
    ),
    "invalid JSON": (b"{not json", "application/json"),
    "not UTF-8": (b'{"prompt": "\xff\xfe"}', "application/json"),
    "empty": (b"", "application/json"),
    "not an object": (b"[1, 2, 3]", "application/json"),
    "a form, not JSON": (b"prompt=Hello&max_tokens=4", "application/x-www-form-urlencoded"),
    "text/plain garbage": (b"\x00\x01\x02", "text/plain"),
}


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_every_front_answers_a_hostile_body_with_a_json_400(fronts, front, name):
    body, content_type = HOSTILE_BODIES[name]
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{fronts[front]}{path}", content=body, headers={"content-type": content_type}, timeout=60)
        assert r.status_code == 400, (front, path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
def test_every_front_refuses_a_huge_declared_body_with_a_json_413(fronts, front):
    url = urlparse(fronts[front])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(10**10))
        conn.endheaders(b'{"prompt": "')
        r = conn.getresponse()
        assert r.status == 413, (front, r.status)
        assert json.loads(r.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


def test_the_fronts_still_serve_after_the_hostile_bodies(fronts, alone, server):
    for front in ("server", "router"):
        r = httpx.post(f"{fronts[front]}/v1/completions", json=INNOCENT, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone, (front, r.text)
    assert pool_whole(server.url)
