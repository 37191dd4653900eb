"""`tokenmill serve --reasoning-parser qwen3` with SmolLM2 (a model that does not think by itself).

What can be checked with it, and is: responses and streams split `reasoning_content` from `content`
identically; `max_reasoning_tokens` forces "</think>" after that many tokens, and an output constraint
(JSON schema, named tool) applies only after it; a prompt that already closed the thinking gets
constrained content from the first token. A real thinking model's own `<think>` output is covered only
by the parser's unit tests on synthetic text (tests/test_reasoning_parser.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_server_utils import MODEL, model_available, running_server

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "shade": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["color", "shade"],
}
ASK = [{"role": "user", "content": "Pick a color and a shade."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(
        tmp_path_factory,
        "reasoning",
        "--dtype",
        "float32",
        "--reasoning-parser",
        "qwen3",
        "--num-kv-blocks",
        "200",
        "--max-model-len",
        "1024",
        "--log-interval",
        "0",
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def streamed(client, **kwargs) -> tuple[str | None, str | None, list[tuple[str, str]], str]:
    """(reasoning, content, [(tool name, arguments)], finish_reason) of a streamed chat."""
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        extra = choice.delta.model_extra or {}
        if extra.get("reasoning_content"):
            reasoning.append(extra["reasoning_content"])
        if choice.delta.content:
            content.append(choice.delta.content)
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, ["", ""])
            call[0] += tc.function.name or "" if tc.function else ""
            call[1] += tc.function.arguments or "" if tc.function else ""
        finish = choice.finish_reason or finish
    return ("".join(reasoning) or None, "".join(content) or None, [tuple(calls[i]) for i in sorted(calls)], finish)


def test_budget_then_json_schema(client, tokenizer):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": 6},
    )
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    reasoning = reasoning_of(msg)
    assert reasoning and r.choices[0].finish_reason == "stop"
    assert len(tokenizer.encode(reasoning, add_special_tokens=False)) <= 6 + 1  # re-tokenizing may merge/split one
    jsonschema.validate(json.loads(msg.content), SCHEMA)  # constrained only after the forced </think>
    assert streamed(client, **kwargs) == (reasoning, msg.content, [], "stop")
    end = len(tokenizer.encode("</think>", add_special_tokens=False))
    assert r.usage.completion_tokens_details.reasoning_tokens == 6 + end  # the budget, then the forced marker


def test_budget_without_constraint_splits_at_the_forced_end(client, tokenizer):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=14, temperature=0, extra_body={"max_reasoning_tokens": 4})
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert r.usage.completion_tokens == 14 and r.choices[0].finish_reason == "length"
    assert reasoning_of(msg) and msg.content  # 4 tokens of thinking, the forced end, then 14 - 4 - 3 of answer
    assert len(end) == 3
    assert streamed(client, **kwargs) == (reasoning_of(msg), msg.content, [], "length")


def test_a_model_that_never_closes_its_thinking_is_all_reasoning(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert reasoning_of(msg) and msg.content is None


def test_prompt_that_closed_the_thinking_is_constrained_from_the_start(client):
    messages = [{"role": "user", "content": "<think>I already decided.</think> Pick a color and a shade."}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert reasoning_of(msg) is None
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert streamed(client, **kwargs) == (None, msg.content, [], "stop")


def test_named_tool_after_reasoning(client):
    tools = [{"type": "function", "function": {"name": "paint", "parameters": SCHEMA}}]
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=64,
        temperature=0,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "paint"}},
        extra_body={"max_reasoning_tokens": 5},
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert reasoning_of(choice.message) and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "paint"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert streamed(client, **kwargs) == (
        reasoning_of(choice.message),
        None,
        [("paint", call.function.arguments)],
        "tool_calls",
    )
