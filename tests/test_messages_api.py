"""POST /v1/messages and /v1/messages/count_tokens through a real `tokenmill serve` and the official
`anthropic` client: thinking and text blocks, streams whose events build the same message, a
tool_use / tool_result round trip, stop_sequences, x-api-key and Bearer auth, 4xx in Anthropic's error
shape naming the field, and the KV pool whole after an abandoned stream.

The model is a tiny random-weight Llama with the default model's tokenizer and chat template, served
with `--reasoning-parser qwen3`: it never closes its thinking by itself, so requests that want an answer
or a tool call give it a thinking budget (`thinking.budget_tokens`); tool calls come from a forced
tool_choice (the structured-output engine writes them)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_server_utils import ADD_ARGUMENTS as ADD
from test_server_utils import TINY_CHAT_KEY, model_available, wait_pool_whole

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

MODEL = "tiny"
KEY = TINY_CHAT_KEY
TOOLS = [{"name": "add", "description": "Add two integers", "input_schema": ADD}]
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
THINK = {"type": "enabled", "budget_tokens": 3}
GREEDY = {"temperature": 0}  # the SDK has no `temperature` argument any more; the API still takes it


@pytest.fixture(scope="module")
def server(tiny_chat):
    return tiny_chat


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def streamed(client, **kwargs):
    """(the raw events, the message the SDK built from them) of a streamed `messages.create`."""
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def without_ids(message) -> dict:
    """The message without its ids, its prompt tokens counted whether the prefix cache had them or not."""
    out = message.model_dump()
    out.pop("id")
    for block in out["content"]:
        block.pop("id", None)
    usage = out["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    return out


def test_thinking_then_text_streams_as_it_responds(client, tokenizer):
    kwargs = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY, thinking=THINK)
    m = client.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "max_tokens"
    assert m.content[0].thinking and m.content[1].text and m.usage.output_tokens == 12
    counted = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted

    events, final = streamed(client, **kwargs)
    raw = [e.type for e in events if e.type not in ("text", "thinking", "signature", "input_json")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == 2
    assert without_ids(final) == without_ids(m)  # greedy, and the stream's usage is the message's


def test_tool_use_round_trip(client):
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "add"},
        thinking={"type": "enabled", "budget_tokens": 2},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    call = first.content[1]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD)

    conversation = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]},
    ]
    then = client.messages.create(model=MODEL, max_tokens=4, messages=conversation, tools=TOOLS, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=TOOLS).input_tokens
    assert then.usage.input_tokens + then.usage.cache_read_input_tokens == counted
    assert counted > client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS).input_tokens


def test_streamed_tool_use_builds_the_call(client):
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2},
        extra_body=GREEDY,
    )
    events, final = streamed(client, **kwargs)
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    jsonschema.validate(final.content[-1].input, ADD)
    assert without_ids(client.messages.create(**kwargs)) == without_ids(final)


def test_stop_sequences(client):
    kwargs = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY, thinking=THINK)
    text = client.messages.create(**kwargs).content[1].text
    stop = text.strip()[:3]
    m = client.messages.create(stop_sequences=[stop], **kwargs)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and m.usage.output_tokens < 12


def test_output_config_json_schema_constrains_the_answer(client):
    m = client.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=ASK,
        system="Answer in JSON.",
        output_config={"format": {"type": "json_schema", "schema": ADD}},
        thinking={"type": "enabled", "budget_tokens": 2},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn" and m.content[-1].type == "text"
    jsonschema.validate(json.loads(m.content[-1].text), ADD)


def test_auth_by_x_api_key_or_bearer(server):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    url = f"{server.url}/v1/messages"
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    r = httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"system": 5}, "system"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "tools[0].input_schema"),
    ({"tools": TOOLS * 129}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "missing"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"stop_sequences": ["x" * 1000]}, "stop_sequences"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "output_config.format.schema"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_an_anthropic_400_naming_the_field(server, fields, param):
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 4, "messages": ASK, **fields}.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"], body


def test_other_errors_keep_the_anthropic_shape(server):
    headers = {"x-api-key": KEY}
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    body = {"model": "claude-x", "max_tokens": 4, "messages": ASK}
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=headers, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_an_abandoned_stream_returns_its_blocks(server):
    body = {"model": MODEL, "max_tokens": 500, "messages": ASK, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        while "content_block_delta" not in next(lines):
            pass
    wait_pool_whole(server.url)
