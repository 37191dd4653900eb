"""The Responses and Messages APIs' translations, in-process: their requests into chat requests, the
chat path's errors renamed to their fields, and chat output deltas into blocks."""

from __future__ import annotations

import json

import pytest

from tokenmill.http_front import anthropic_error
from tokenmill.server.output_blocks import OutputBlocks
from tokenmill.server.protocol import APIError, bad_request, parse_body, renamed
from tokenmill.server.protocol_anthropic import RENAMES as MESSAGES_RENAMES
from tokenmill.server.protocol_anthropic import MessagesRequest
from tokenmill.server.protocol_responses import RENAMES as RESPONSES_RENAMES
from tokenmill.server.protocol_responses import ResponsesRequest


def _parse(model, body: dict):
    return parse_body(model, json.dumps(body).encode())


def test_responses_items_become_chat_messages():
    req = _parse(
        ResponsesRequest,
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2 + 3?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
            ],
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "add"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        },
    )
    messages = req.input_messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Let me add." and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    chat = req.chat_request(messages)
    assert chat.chat_messages()[0] == {"role": "system", "content": "Be brief."}
    assert chat.tool_mode() == ("named", "add") and chat.tools[0].function.parameters == {"type": "object"}
    assert chat.structured_spec()[1] == "response_format.json_schema.schema"


def test_messages_blocks_become_chat_messages():
    req = _parse(
        MessagesRequest,
        {
            "max_tokens": 64,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "2 + 3?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "adding", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "5"}]},
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tools": [{"name": "add", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "thinking": {"type": "enabled", "budget_tokens": 16},
        },
    )
    chat = req.chat_request("qwen3")
    messages = chat.chat_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "Be brief." and messages[3] == {
        "role": "tool",
        "content": "5",
        "tool_call_id": "t1",
    }
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert chat.tool_mode() == ("required", None) and not chat.parallel_tool_calls
    assert chat.stop == ["END"] and chat.max_reasoning_tokens == 16
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert req.chat_request(None).max_reasoning_tokens is None  # no parser: the model cannot think apart


@pytest.mark.parametrize(
    "param, renames, expected",
    [
        ("messages", RESPONSES_RENAMES, "input"),
        ("max_completion_tokens", RESPONSES_RENAMES, "max_output_tokens"),
        ("tools[3].function.parameters", RESPONSES_RENAMES, "tools[3].parameters"),
        ("response_format.json_schema.schema", RESPONSES_RENAMES, "text.format.schema"),
        ("tools[0].function.parameters", MESSAGES_RENAMES, "tools[0].input_schema"),
        ("tools[0].function.name", MESSAGES_RENAMES, "tools[0].name"),
        ("stop", MESSAGES_RENAMES, "stop_sequences"),
        ("max_reasoning_tokens", MESSAGES_RENAMES, "thinking.budget_tokens"),
        ("temperature", MESSAGES_RENAMES, "temperature"),
    ],
)
def test_chat_errors_name_the_api_field(param, renames, expected):
    e = renamed(bad_request(f"{param}: is wrong", param), renames)
    assert e.param == expected and e.message == f"{expected}: is wrong"


def test_anthropic_error_shape_names_the_field():
    body = anthropic_error(bad_request("must be positive", "max_tokens"))
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: must be positive"},
    }
    assert anthropic_error(APIError(503, "restarting"))["error"]["type"] == "overloaded_error"


def test_output_deltas_become_blocks_in_order():
    blocks = OutputBlocks()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
    events = blocks.feed(
        [
            {"reasoning_content": "hm"},
            {"reasoning_content": "m"},
            {"content": "ok"},
            {"tool_calls": [call]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        ]
    )
    events += blocks.feed([{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]) + blocks.close(True)
    kinds = [(e.kind, e.block.index, e.text) for e in events]
    assert kinds == [
        ("start", 0, ""),
        ("delta", 0, "hm"),
        ("delta", 0, "m"),
        ("stop", 0, ""),
        ("start", 1, ""),
        ("delta", 1, "ok"),
        ("stop", 1, ""),
        ("start", 2, ""),
        ("delta", 2, '{"a"'),
        ("delta", 2, ": 1}"),
        ("stop", 2, ""),
    ]
    assert [e.final for e in events if e.kind == "stop"] == [False, False, True]
    assert [(b.kind, b.text, b.name) for b in blocks.blocks] == [
        ("reasoning", "hmm", None),
        ("text", "ok", None),
        ("tool_call", '{"a": 1}', "add"),
    ]
