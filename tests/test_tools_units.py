"""Tool calling without a model: the default prompt format, the constraint schemas, and the three output
parsers, whole and streamed in every way of cutting the text."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tokenmill.structured import tools as T

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def _splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _run(make, pieces):
    parser = make()
    content, calls = [], []
    for piece in pieces:
        for event in parser.feed(piece):
            T.apply_event(event, content, calls)
    for event in parser.finish():
        T.apply_event(event, content, calls)
    return "".join(content), calls


def _check_streams(make, text, expected):
    assert T.collect(make(), text) == expected
    for pieces in _splits(text, random.Random(len(text))):
        assert _run(make, pieces) == expected, pieces


HERMES_CASES = [
    ("Just text.", ("Just text.", [])),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]),
    ),
    (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "parameters": {"tz": "CET"}}</tool_call> done',
        (
            "Let me check. \n done",
            [
                {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                {"name": "get_time", "arguments": '{"tz": "CET"}'},
            ],
        ),
    ),
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),  # stays content
    ('<tool_call>{"name": "ping"}', ("", [{"name": "ping", "arguments": "{}"}])),  # unclosed at the end, valid
    ('<tool_call>{"name": "pi', ('<tool_call>{"name": "pi', [])),  # unclosed and cut: content
    ("a <tool_c", ("a <tool_c", [])),  # a partial tag at the end is text
    (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments written as a JSON string
        ("", [{"name": "f", "arguments": '{"x": 1}'}]),
    ),
]


@pytest.mark.parametrize("text,expected", HERMES_CASES)
def test_hermes_parser(text, expected):
    _check_streams(lambda: T.HermesToolParser(), text, expected)


def test_hermes_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert T.collect(T.HermesToolParser(parallel=False), text) == ("", [{"name": "a", "arguments": "{}"}])


def test_named_parser():
    _check_streams(
        lambda: T.NamedToolParser("get_weather"),
        '{"city": "Paris"}',
        ("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]),
    )
    assert T.collect(T.NamedToolParser("ping"), "") == ("", [{"name": "ping", "arguments": ""}])


ARRAY_CASES = [
    (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        ("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]),
    ),
    (
        '[{"name": "get_weather", "arguments": {"city": "a}b\\"]"}}, {"name": "get_time", "arguments": {"tz": "[{"}}]',
        (
            "",
            [
                {"name": "get_weather", "arguments": '{"city": "a}b\\"]"}'},
                {"name": "get_time", "arguments": '{"tz": "[{"}'},
            ],
        ),
    ),
    (
        '[ {"name":"ping","arguments":{}} ,{"name": "ping", "arguments": {"n": [1, {"m": []}]}} ]',
        ("", [{"name": "ping", "arguments": "{}"}, {"name": "ping", "arguments": '{"n": [1, {"m": []}]}'}]),
    ),
    ('[{"name": "f", "arguments": 12}]', ("", [{"name": "f", "arguments": "12"}])),
    ('[{"name": "f", "arguments": "s,}"}]', ("", [{"name": "f", "arguments": '"s,}"'}])),
    ("not an array", ("not an array", [])),
]


@pytest.mark.parametrize("text,expected", ARRAY_CASES)
def test_array_parser(text, expected):
    _check_streams(T.ArrayToolParser, text, expected)


def test_array_parser_streams_arguments_before_the_call_ends():
    parser = T.ArrayToolParser()
    events = parser.feed('[{"name": "get_weather", "arguments": {"ci')
    assert events == [("call", 0, "get_weather"), ("args", 0, '{"ci')]
    assert parser.feed('ty": "X"}}]') == [("args", 0, 'ty": "X"}')]


def test_required_schema_accepts_only_calls_of_the_tools():
    schema = T.required_schema([WEATHER, TIME, NOARGS])
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = T.required_schema([WEATHER], parallel=False)
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {
        "type": "string",
        "enum": ["get_weather"],
    }


def test_default_prompt_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = T.render_messages(messages, [WEATHER], native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps({"type": "function", "function": WEATHER["function"]}) in out[0]["content"]
    assert "<tool_call>" in out[0]["content"] and "</tools>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # without a system message one is added; without tools nothing is
    assert T.render_messages(messages[1:2], [WEATHER], native=False)[0]["role"] == "system"
    assert T.render_messages(messages[1:2], None, native=False) == [messages[1]]
    # a template that handles tools gets OpenAI-shaped messages, arguments as objects
    native = T.render_messages(messages, [WEATHER], native=True)
    assert native[0] == {"role": "system", "content": "Be brief."}
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert T.template_supports_tools("{% if tools %}...{% endif %}") and not T.template_supports_tools("{{ x }}")
