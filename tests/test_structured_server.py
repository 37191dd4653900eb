"""Structured output and tool calling through a real `tokenmill serve`: OpenAI response_format, vLLM's
structured_outputs / guided_* extras on both endpoints, tool_choice required / named / auto, 400s for
invalid specs, streaming equal to non-streaming, constrained and unconstrained requests together."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from test_server_utils import MODEL, metric_values, model_available, running_server, sse_events

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["tz"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
            },
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(
        tmp_path_factory,
        "structured",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "400",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
        "--log-interval",
        "0",
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def stream_chat(client, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as {"id", "name", "arguments"}, finish_reason) of a streamed chat."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = choice.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def full_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def test_response_format_json_schema(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    content, calls, finish = stream_chat(client, **kwargs)
    assert (content, calls, finish) == (choice.message.content, [], "stop")  # streaming agrees


def test_response_format_json_object_on_both_endpoints(client):
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": 'Repeat exactly: {"a": 1, "b": [2]}'}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(
        model=MODEL,
        prompt='Output: {"city": "Rome"}\nOutput:',
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(c.choices[0].text), dict)


def test_regex_choice_grammar_and_guided_names(server, client):
    grammar = 'root ::= num (("+" | "*") num){1,3}\nnum ::= [1-9] [0-9]?'
    cases = [
        (
            {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", t),
        ),
        (
            {"guided_regex": r"(yes|no), because [a-z ]{5,20}\."},
            lambda t: re.fullmatch(r"(yes|no), because [a-z ]{5,20}\.", t),
        ),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
        ({"structured_outputs": {"grammar": grammar}}, lambda t: re.fullmatch(r"[1-9][0-9]?([+*][1-9][0-9]?){1,3}", t)),
        ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"[1-9][0-9]?([+*][1-9][0-9]?){1,3}", t)),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ]
    for extra, check in cases:
        for seed in (1, 2):
            chat = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Answer."}],
                max_tokens=60,
                temperature=1.0,
                seed=seed,
                extra_body=extra,
            )
            text = chat.choices[0].message.content
            assert chat.choices[0].finish_reason == "stop" and check(text), (extra, text)
        comp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=0, extra_body=extra)
        assert comp.choices[0].finish_reason == "stop" and check(comp.choices[0].text), (extra, comp.choices[0].text)
    # streaming completions agree with non-streaming
    body = {
        "model": MODEL,
        "prompt": "Colors:",
        "max_tokens": 60,
        "temperature": 0,
        "structured_outputs": {"regex": r"[a-z]{3,6}(, [a-z]{3,6}){2}"},
    }
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json=dict(body, stream=True), timeout=300) as resp:
        events = [json.loads(e) for e in sse_events(resp) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == full
    assert re.fullmatch(r"[a-z]{3,6}(, [a-z]{3,6}){2}", full)


def test_tool_choice_required_always_yields_valid_calls(client):
    for seed in range(4):  # one call per response: the output always completes
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0.0 if seed == 0 else 1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = full_calls(choice.message)
        assert len(calls) == 1 and calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL_SCHEMAS[calls[0]["name"]])
    # parallel calls: the array is unbounded and this small model tends to repeat calls until max_tokens, so
    # only the calls that completed are checked (a call cut by max_tokens has truncated arguments, as in OpenAI)
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=seed
        )
        choice = r.choices[0]
        calls = full_calls(choice.message)
        assert calls and len({c["id"] for c in calls}) == len(calls) and choice.message.content is None
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert choice.finish_reason in ("tool_calls", "length")
        for call in complete:
            jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


def test_named_tool_choice_always_yields_valid_arguments(client):
    for name in TOOL_SCHEMAS:
        for seed in (0, 1):
            r = client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": name}},
                max_tokens=80,
                temperature=1.0,
                seed=seed,
            )
            choice = r.choices[0]
            calls = full_calls(choice.message)
            assert choice.finish_reason == "tool_calls" and [c["name"] for c in calls] == [name]
            jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL_SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_tool_calls_match_the_response(client, tool_choice):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Add 2 and 3, then get the time in UTC."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = stream_chat(client, **kwargs)
    strip = lambda cs: [(c["name"], c["arguments"]) for c in cs]  # noqa: E731 - ids are random per response
    assert content is None and finish == full.finish_reason == "tool_calls"
    assert strip(calls) == strip(full_calls(full.message)) and all(c["id"] for c in calls)


def test_auto_tool_choice_and_tool_messages(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    for messages in (ASK, history):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0)
        choice = r.choices[0]
        calls = full_calls(choice.message)
        assert choice.finish_reason == ("tool_calls" if calls else choice.finish_reason)
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert calls or choice.message.content  # text, parsed calls, or both
        content, streamed, finish = stream_chat(
            client, model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0
        )
        assert content == choice.message.content and finish == choice.finish_reason
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"


BAD = [
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}},
            }
        },
        "response_format.json_schema.schema",
        "invalid JSON schema",
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
            }
        },
        "response_format.json_schema.schema",
        "minimum",
    ),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "must be"),
    ("/v1/completions", {"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs.regex", "invalid regex"),
    ("/v1/completions", {"guided_regex": "[0-9"}, "guided_regex", "invalid regex"),
    (
        "/v1/completions",
        {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        "structured_outputs.grammar",
        'Rule "undefined_rule" is not defined',
    ),
    ("/v1/chat/completions", {"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "invalid grammar"),
    ("/v1/completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    (
        "/v1/chat/completions",
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
        "only one output constraint",
    ),
    (
        "/v1/chat/completions",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}},
                }
            ]
        },
        "tools[0].function.parameters",
        "invalid JSON schema",
    ),
    (
        "/v1/chat/completions",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        "tool_choice",
        "not in tools",
    ),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "requires tools"),
    (
        "/v1/chat/completions",
        {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
        "guided_regex",
        "cannot be combined",
    ),
    ("/v1/chat/completions", {"max_reasoning_tokens": 8}, "max_reasoning_tokens", "--reasoning-parser"),
]


@pytest.mark.parametrize("path,fields,param,words", BAD)
def test_invalid_specs_are_400s_before_queueing(server, path, fields, param, words):
    before = metric_values(server.url)
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body["messages" if "chat" in path else "prompt"] = [{"role": "user", "content": "hi"}] if "chat" in path else "hi"
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    after = metric_values(server.url)
    assert after.get("tokenmill:prompt_tokens_total") == before.get("tokenmill:prompt_tokens_total")


def test_constrained_and_unconstrained_together(server, client):
    free = dict(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=24, temperature=0
    )
    alone = client.chat.completions.create(**free).choices[0].message.content
    aclient = server.openai_client(asynchronous=True)

    async def both():
        constrained = aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A person, as JSON."}],
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
        return await asyncio.gather(constrained, aclient.chat.completions.create(**free))

    constrained, unconstrained = asyncio.run(both())
    jsonschema.validate(json.loads(constrained.choices[0].message.content), PERSON)
    assert unconstrained.choices[0].message.content == alone
    m = metric_values(server.url)
    assert m["tokenmill:structured_output_compiles_total"] >= 1
    assert m["tokenmill:structured_output_compile_seconds_total"] > 0
