"""POST /v1/responses through a real `tokenmill serve` and the official `openai` client's
`client.responses.create`: reasoning and message items, streams whose events build the same response,
a function-call round trip (sent back as items, and through previous_response_id), text.format
json_schema, the bounded response store, 400s naming the Responses field, and the KV pool whole after
an abandoned stream.

The model is a tiny random-weight Llama with the default model's tokenizer and chat template, served
with `--reasoning-parser qwen3`: it never closes its thinking by itself, so the requests that want
an answer or a tool call give it a thinking budget (`max_reasoning_tokens`); tool calls come from a
forced tool_choice (the structured-output engine writes them)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_server_utils import ADD_ARGUMENTS as ADD
from test_server_utils import TINY_CHAT_KEY, model_available, wait_pool_whole

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

MODEL = "tiny"
TOOLS = [{"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD}]
ASK = "What is 2 + 3?"
AUTH = {"Authorization": f"Bearer {TINY_CHAT_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_chat):
    return tiny_chat


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(TINY_CHAT_KEY)


def streamed(client, **kwargs) -> tuple[list, object]:
    """(every event, the response of the last one) of a streamed `responses.create`."""
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events, events[-1].response


def without_ids(output) -> list[dict]:
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in output]


def test_reasoning_then_text_streams_as_it_responds(client, tokenizer):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=12, temperature=0, extra_body={"max_reasoning_tokens": 3})
    r = client.responses.create(**kwargs)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in r.output] == ["completed", "incomplete"]
    end = len(tokenizer.encode("</think>", add_special_tokens=False))
    assert r.usage.output_tokens == 12 and r.usage.output_tokens_details.reasoning_tokens == 3 + end
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.output_text

    events, final = streamed(client, **kwargs)
    assert events[-1].type == "response.incomplete" and final.usage.output_tokens == 12
    assert without_ids(final.output) == without_ids(r.output)  # greedy: the same output, item by item
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == r.output[0].content[0].text and text == r.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert without_ids(done) == without_ids(r.output)


def test_function_call_round_trip_as_items_and_by_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=60,
        temperature=0,
        extra_body={"max_reasoning_tokens": 2},
    )
    assert first.status == "completed" and [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "add" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    then = dict(model=MODEL, tools=TOOLS, max_output_tokens=6, temperature=0)
    as_items = client.responses.create(input=[{"role": "user", "content": ASK}, *first.output, result], **then)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **then)
    # the stored conversation renders to the same prompt as the items sent back: the same greedy output
    assert chained.usage.input_tokens == as_items.usage.input_tokens > first.usage.input_tokens
    assert without_ids(chained.output) == without_ids(as_items.output)
    assert chained.previous_response_id == first.id


def test_streamed_tool_call_arguments_build_the_call(client):
    kwargs = dict(
        model=MODEL,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
        extra_body={"max_reasoning_tokens": 2},
    )
    events, final = streamed(client, **kwargs)
    assert events[-1].type == "response.completed"
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "add"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == call.arguments == done[0].arguments
    jsonschema.validate(json.loads(arguments), ADD)
    assert without_ids(client.responses.create(**kwargs).output) == without_ids(final.output)


def test_text_format_json_schema_constrains_the_answer(client):
    r = client.responses.create(
        model=MODEL,
        input=ASK,
        instructions="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "sum", "schema": ADD, "strict": True}},
        max_output_tokens=80,
        temperature=0,
        extra_body={"max_reasoning_tokens": 2},
    )
    assert r.status == "completed" and r.instructions == "Answer in JSON."
    jsonschema.validate(json.loads(r.output_text), ADD)


def test_the_store_keeps_the_last_responses_only(client):
    ids = [client.responses.create(model=MODEL, input=f"turn {i}", max_output_tokens=1).id for i in range(3)]
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False).id
    client.responses.create(model=MODEL, previous_response_id=ids[2], input="more", max_output_tokens=1)
    for gone in (ids[0], unstored):  # --max-stored-responses 2: the oldest was dropped
        with pytest.raises(Exception) as e:
            client.responses.create(model=MODEL, previous_response_id=gone, input="more", max_output_tokens=1)
        assert e.value.status_code == 400 and e.value.body["param"] == "previous_response_id"


BAD = [
    ({"input": 5}, "input"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": TOOLS * 129}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
    ({"max_output_tokens": 10**12}, "max_output_tokens"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"instructions": 123}, "instructions"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "word " * 2000}, "input"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"background": True}, "background"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_a_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]


def test_missing_input_and_unknown_model(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "gpt-x", "input": "hi"}, headers=AUTH, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_an_abandoned_stream_returns_its_blocks(server):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 500, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
        while "output_item.added" not in next(lines):
            pass
    wait_pool_whole(server.url)
