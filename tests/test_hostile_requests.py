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


@pytest.mark.parametrize(
    "field, value", [("temperature", 1e308), ("temperature", 1e39), ("repetition_penalty", 1e-300)]
)
def test_numbers_that_overflow_the_logits_are_a_400(client, server, alone, field, value):
    """Past float32's range a masked token's logit (-inf) over the temperature is NaN, and the sampler then
    picks a token the request's grammar refuses: a 500 once, with a constraint."""
    constrained = {field: value, "structured_outputs": {"choice": ["yes", "no"]}}
    result, innocent = beside_innocent(
        client, lambda: client.completions.create(**dict(INNOCENT, prompt="Hi", max_tokens=4), extra_body=constrained)
    )
    assert_bad_request(result, field, "must be in")
    assert innocent == alone and pool_whole(server.url)


@pytest.mark.parametrize("bias", [{"\u00b2": 1}, {"-3": 1}, {"12a": 1}, {"9" * 5000: 1}])
def test_logit_bias_keys_that_are_not_token_ids_are_a_400(client, bias):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**INNOCENT, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias", e.value.body


def test_a_client_that_leaves_while_its_grammar_compiles_is_aborted_before_it_runs(server, client, alone):
    """A 20,000-way choice compiles for seconds in the engine; its client leaves meanwhile. The request is
    aborted then, not once its grammar is ready and its first token out (the requests behind it wait)."""
    before = metric_values(server.url)
    aborts = 'tokenmill:request_success_total{finished_reason="abort"}'
    choices = [f"option {i} of many" for i in range(20_000)]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "structured_outputs": {"choice": choices}}
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    wait_for(lambda: metric_values(server.url)["tokenmill:num_requests_waiting"] >= 1, 120)  # it compiles
    conn.close()  # the client leaves
    wait_for(lambda: metric_values(server.url).get(aborts, 0) == before.get(aborts, 0) + 1, 120)
    after = metric_values(server.url)
    assert after["tokenmill:generation_tokens_total"] == before["tokenmill:generation_tokens_total"]
    assert client.completions.create(**INNOCENT).choices[0].text == alone
    assert pool_whole(server.url)


# ---- prompts far past the context ---------------------------------------------------------------------


def test_a_text_no_context_could_hold_is_a_400_before_it_is_tokenized(client, tokenizer, alone):
    most = 512 * 4 * max(len(t) for t in tokenizer.hf.get_vocab())  # --max-model-len 512: 4 x its longest tokens
    result, innocent = beside_innocent(
        client, lambda: client.completions.create(**dict(INNOCENT, prompt="a" * (most + 1)))
    )
    assert_bad_request(result, "prompt", f"at most {most} characters")
    assert result.body["code"] == "context_length_exceeded" and innocent == alone


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
def test_a_long_text_is_refused_from_its_first_part(server, path, field):
    words = "the cat sat on the mat. " * 2000  # 48,000 characters: ~12,000 tokens, for 512 of context
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, field: words}, timeout=120)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert "first 8192 characters" in error["message"], error


def test_whitespace_runs_that_fit_are_served(client):
    """One token holds a run of dozens of spaces: 20,000 characters of them fit 512 tokens, and the first
    part's probe lets them through."""
    text = "x" + " " * 20_000 + "y"
    result = client.completions.create(**dict(INNOCENT, prompt=text, max_tokens=1))
    assert result.usage.prompt_tokens < 512


def test_token_ids_past_the_context_are_a_400_naming_the_field(server):
    ids = [1000] * 100_000
    for path, field in (("/v1/completions", "prompt"), ("/v1/embeddings", "input"), ("/detokenize", "tokens")):
        r = httpx.post(f"{server.url}{path}", json={"model": MODEL, field: ids}, timeout=120)
        assert r.status_code == 400, (path, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == field and "100000 token ids" in error["message"], (path, error)


def test_embedding_ids_outside_the_vocabulary_name_input(server):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": [1, 10**9]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text[:300]


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


# ---- fields that mean nothing where they are --------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, field, words",
    [
        ("/v1/completions", dict(INNOCENT, stream_options={"include_usage": True}), "stream_options", "stream: true"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "priority": 2**70}, "priority", "less than or equal"),
        ("/v1/completions", dict(INNOCENT, priority=-(2**63) - 1), "priority", "greater than or equal"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "text only",
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
            "'any' requires tools",
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": -1},
            },
            "thinking.budget_tokens",
            "greater than or equal to 1",
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": 16},
            },
            "thinking.budget_tokens",
            "must be greater than thinking.budget_tokens",
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}],
            },
            "messages[0].content[0].type",
            "belong in assistant messages",
        ),
    ],
)
def test_a_field_that_cannot_apply_is_a_400_naming_it(server, path, body, field, words):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, (path, r.text[:300])
    error = r.json()["error"]
    assert error.get("param", field) == field and field in error["message"] and words in error["message"], error
    assert error["message"].count(field) == 1, error  # named once, not path: path: message


# ---- item types that are not names -------------------------------------------------------------------

TAGGED = {  # path -> (a body whose first item gets the `type`, the field the 400 names)
    "/v1/responses": ({"model": MODEL, "input": [{"type": None, "role": "user", "content": "x"}]}, "input[0].type"),
    "/v1/messages": (
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": None, "text": "x"}]}]},
        "messages[0].content[0].type",
    ),
    "/v1/messages/count_tokens": (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": None, "text": "x"}]}]},
        "messages[0].content[0].type",
    ),
}


@pytest.mark.parametrize("path", list(TAGGED))
@pytest.mark.parametrize("kind", [["message"], {"a": 1}, 3])
def test_an_item_type_that_is_not_a_string_is_a_400_and_the_connection_serves_on(server, alone, path, kind):
    body, field = json.loads(json.dumps(TAGGED[path][0])), TAGGED[path][1]
    item = body["input"][0] if "input" in body else body["messages"][0]["content"][0]
    item["type"] = kind
    with httpx.Client(base_url=server.url, timeout=120) as keep_alive:  # one connection for both requests
        r = keep_alive.post(path, json=body)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error.get("param", field) == field and field in error["message"], error
        again = keep_alive.post("/v1/completions", json=INNOCENT)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone


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
}
# bodies that say they are not JSON, even when they hold JSON: what another site's page may send without a
# preflight (a form, text/plain); a 415, never parsed
NOT_JSON_BODIES = {
    "a form": (b"prompt=Hello&max_tokens=4", "application/x-www-form-urlencoded"),
    "text/plain garbage": (b"\x00\x01\x02", "text/plain"),
    "JSON as text/plain": (json.dumps(INNOCENT).encode(), "text/plain;charset=UTF-8"),
    "JSON as a multipart form": (json.dumps(INNOCENT).encode(), "multipart/form-data; boundary=x"),
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
@pytest.mark.parametrize("name", list(NOT_JSON_BODIES))
def test_every_front_refuses_a_body_that_is_not_json_with_a_415(fronts, front, name):
    body, content_type = NOT_JSON_BODIES[name]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        r = httpx.post(f"{fronts[front]}{path}", content=body, headers={"content-type": content_type}, timeout=60)
        assert r.status_code == 415, (front, path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "not JSON" in error["message"], error


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
def test_a_header_byte_past_ascii_passes_every_front(fronts, front, alone):
    """HTTP allows such bytes in a header's value; the fronts re-encoded the headers they pass on as ASCII
    and answered a 500."""
    headers = {"x-note": "caf\xe9 \xff".encode("latin-1")}
    r = httpx.post(f"{fronts[front]}/v1/completions", json=INNOCENT, headers=headers, timeout=120)
    if front == "proxy":  # its two roles are this one plain server here: the server's 400 shows it got through
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text[:300]
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone, r.text[:300]


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
def test_every_front_refuses_work_from_another_sites_page(fronts, front):
    """A browser marks a request another site's page makes (Sec-Fetch-Site: cross-site); a page may send a
    POST without a content type, which no check of the body's type stops: a 403 in the API's shape."""
    cross = {"sec-fetch-site": "cross-site"}
    r = httpx.post(f"{fronts[front]}/v1/completions", content=json.dumps(INNOCENT).encode(), headers=cross, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", r.text[:300]
    r = httpx.post(f"{fronts[front]}/v1/messages", content=b"{}", headers=cross, timeout=60)
    assert r.status_code == 403 and r.json()["type"] == "error" and "another site" in r.json()["error"]["message"]
    assert httpx.get(f"{fronts[front]}/health", headers=cross, timeout=60).status_code == 200  # reading is fine
    if front == "server":  # the page's own requests are same-origin
        r = httpx.post(f"{fronts[front]}/v1/completions", json=INNOCENT, headers={"sec-fetch-site": "same-origin"})
        assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
def test_every_front_answers_a_bad_messages_body_in_anthropics_shape(fronts, front):
    r = httpx.post(f"{fronts[front]}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("front", ["server", "router", "proxy"])
def test_every_front_answers_head_on_health(fronts, front):
    assert httpx.head(f"{fronts[front]}/health", timeout=60).status_code == 200
    assert httpx.post(f"{fronts[front]}/health", timeout=60).status_code == 405


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
