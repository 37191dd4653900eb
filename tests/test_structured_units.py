"""Structured output without a model: specs and their validation, the grammar compiler and matcher on
the real SmolLM2 tokenizer, bitmask helpers, and the request-field parsing of the server."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_server_utils import MODEL, model_available

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from tokenmill.structured import ReasoningSpec, StructuredOutputSpec, check_spec
from tokenmill.structured.backend import (
    GrammarCompiler,
    GrammarMatcher,
    TokenizerData,
    allocate_bitmask,
    apply_bitmask,
    set_single_token,
)
from tokenmill.structured.spec import choice_ebnf

needs_model = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")


# ---- specs ------------------------------------------------------------------------------------------


def test_spec_constructors_and_keys():
    a = StructuredOutputSpec.json({"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = StructuredOutputSpec.json('{"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}')
    assert a == b and a.key == b.key and len(a.key) == 64
    assert a.value == '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}'  # property order kept
    reordered = StructuredOutputSpec.json({"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}})
    assert reordered.key != a.key  # order is the output's order: a different grammar
    keys = {
        StructuredOutputSpec.regex("a+").key,
        StructuredOutputSpec.grammar("a+").key,
        StructuredOutputSpec.choice(["a+"]).key,
        StructuredOutputSpec.json_object().key,
    }
    assert len(keys) == 4
    assert StructuredOutputSpec.json_object().schema == {"type": "object"}
    assert SamplingParams(structured_output=a).structured_output is a


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: StructuredOutputSpec.json("{not json"), "not valid JSON"),
        (lambda: StructuredOutputSpec.json("[1, 2]"), "must be a JSON object"),
        (lambda: StructuredOutputSpec.choice([]), "non-empty list"),
        (lambda: StructuredOutputSpec.choice("yes"), "list of strings"),
        (lambda: StructuredOutputSpec.choice(["a", ""]), "non-empty strings"),
        (lambda: StructuredOutputSpec.regex(""), "non-empty string"),
        (lambda: StructuredOutputSpec("xml", "x"), "kind must be one of"),
        (lambda: ReasoningSpec(budget=-1, end_token_ids=(1,)), "budget"),
        (lambda: ReasoningSpec(budget=3), "end_token_ids"),
        (lambda: SamplingParams(structured_output={"type": "object"}), "structured_output"),
    ],
)
def test_spec_construction_errors(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize(
    "spec,words",
    [
        (StructuredOutputSpec.json({"type": "foo"}), "invalid JSON schema"),
        (StructuredOutputSpec.json({"type": "object", "properties": {"a": {"type": 5}}}), "at 'properties/a/type'"),
        (StructuredOutputSpec.json({"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        (StructuredOutputSpec.json({"type": "string", "pattern": "[a-"}), "is not a 'regex' (at 'pattern')"),
        (StructuredOutputSpec.json({"$ref": "#/$defs/missing"}), "invalid JSON schema"),
        (StructuredOutputSpec.regex("(ab"), "invalid regex: Regex parsing error"),
        (StructuredOutputSpec.grammar("root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutputSpec.grammar('expr ::= "a"'), 'root rule with name "root" is not found'),
    ],
)
def test_check_spec_names_the_problem(spec, words):
    with pytest.raises(ValueError) as e:
        check_spec(spec)
    assert words in str(e.value)
    assert "/project/" not in str(e.value) and "Check failed" not in str(e.value)  # xgrammar's C++ noise removed


def test_check_spec_accepts_valid_specs():
    for spec in [
        StructuredOutputSpec.json({"type": "object", "properties": {"a": {"type": "string"}}}),
        StructuredOutputSpec.json({}),
        StructuredOutputSpec.json_object(),
        StructuredOutputSpec.regex(r"\d{3}-\d{4}"),
        StructuredOutputSpec.choice(["yes", 'a "b"']),
        StructuredOutputSpec.grammar('root ::= "a" | "b"'),
    ]:
        check_spec(spec)


def test_choice_ebnf_escapes():
    text = choice_ebnf(("a", 'say "hi"', "back\\slash", "new\nline"))
    assert text == r'root ::= "a" | "say \"hi\"" | "back\\slash" | "new\nline"'


# ---- xgrammar backend on the real tokenizer -----------------------------------------------------------


@pytest.fixture(scope="module")
def data(tokenizer):
    return TokenizerData.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def compiler(data, tokenizer):
    c = GrammarCompiler(data, tokenizer.vocab_size + 64)  # logits wider than the tokenizer, as in real models
    yield c
    c.shutdown()


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


@needs_model
def test_tokenizer_data_matches_xgrammar_from_huggingface(tokenizer, data):
    """The picklable TokenizerData rebuilds an xgrammar TokenizerInfo with the same masks."""
    import xgrammar as xgr

    ref_info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, stop_token_ids=sorted(tokenizer.eos_token_ids))
    ours = data.xgrammar_info(tokenizer.vocab_size)
    assert ours.vocab_size == ref_info.vocab_size and ours.stop_token_ids == ref_info.stop_token_ids
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}})
    masks = []
    for info in (ref_info, ours):
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(schema))
        assert matcher.accept_string('{"a": "x')
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        masks.append(mask)
    assert torch.equal(masks[0], masks[1])


@needs_model
def test_tokenizer_data_is_made_without_xgrammar_and_decodes_as_xgrammar_does(tokenizer):
    """The server makes TokenizerData at start without importing xgrammar; the bytes it works out on first
    use (in the engine core or a compile worker, after the pickle that carries it there) are xgrammar's own
    reading of the HF tokenizer, and once known they travel with it instead of the tokenizer."""
    import pickle
    import subprocess
    import sys

    import xgrammar as xgr

    made_at_start = (
        "import sys; from tokenmill.loader.source import resolve_model; "
        "from tokenmill.tokenizer import load_tokenizer; "
        "from tokenmill.structured.backend import TokenizerData; "
        f"TokenizerData.from_tokenizer(load_tokenizer(resolve_model({MODEL!r}))); "
        "assert 'xgrammar' not in sys.modules, 'xgrammar was imported'"
    )
    subprocess.run([sys.executable, "-c", made_at_start], check=True, timeout=300)
    ref = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, stop_token_ids=sorted(tokenizer.eos_token_ids))
    data = pickle.loads(pickle.dumps(TokenizerData.from_tokenizer(tokenizer)))  # as the engine core gets it
    assert data.vocab_size == ref.vocab_size and data.stop_token_ids == list(ref.stop_token_ids)
    assert data.decoded_vocab == [bytes(b) for b in ref.decoded_vocab]
    sent = pickle.loads(pickle.dumps(data))  # as a worker restarted later gets it
    assert sent.tokenizer_json is None and sent.decoded_vocab == data.decoded_vocab


@needs_model
def test_compiler_caches_by_key(compiler):
    spec = StructuredOutputSpec.json({"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}})
    before = compiler.stats.num_compiles
    f1 = compiler.compile_async(spec)
    f2 = compiler.compile_async(StructuredOutputSpec.json(json.loads(spec.value)))
    assert f1 is f2  # same key: one compile, shared
    f1.result(timeout=60)
    assert compiler.stats.num_compiles == before + 1
    hits = compiler.stats.cache_hits
    assert compiler.compile_async(spec).done() and compiler.stats.cache_hits == hits + 1
    bad = compiler.compile_async(StructuredOutputSpec.regex("(unclosed"))
    with pytest.raises(ValueError, match="invalid regex"):
        bad.result(timeout=60)
    assert compiler.compile_async(StructuredOutputSpec.regex("(unclosed")) is not bad  # failures are not cached


@needs_model
def test_matcher_accept_rollback_validate_and_terminate(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputSpec.regex(r"(ab)+c"))
    m = GrammarMatcher(compiled, sorted(tokenizer.eos_token_ids))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    abab, c = enc("abab"), enc("c")
    assert m.validate(abab + c) == len(abab + c) and m.num_accepted == 0  # state unchanged
    assert m.validate(enc("ax")) < len(enc("ax"))
    assert m.accept(abab) == len(abab)
    m.rollback(len(abab))
    assert m.num_accepted == 0
    assert m.accept(abab + c) == len(abab + c) and m.is_completed() and not m.is_terminated()
    bitmask = allocate_bitmask(2, compiler.info.vocab_size)
    m.fill_bitmask(bitmask, 1)
    assert _allowed(bitmask, 1, compiler.info.vocab_size) == set(tokenizer.eos_token_ids)  # only the end is left
    eos = next(iter(tokenizer.eos_token_ids))
    assert m.accept([eos]) == 1 and m.is_terminated()


@needs_model
def test_draft_masks_for_speculative_decoding(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputSpec.choice(["alpha beta", "alpha gamma"]))
    m = GrammarMatcher(compiled, sorted(tokenizer.eos_token_ids))
    good = tokenizer.encode("alpha beta", add_special_tokens=False)
    bad = tokenizer.encode("alpha delta", add_special_tokens=False)
    vocab = compiler.info.vocab_size
    bitmask = allocate_bitmask(len(good) + 2, vocab)
    assert m.fill_bitmasks_for_draft(bitmask, 1, good) == len(good) + 1 and m.num_accepted == 0
    for i, token in enumerate(good):  # each row's mask allows the draft's next token
        assert token in _allowed(bitmask, 1 + i, vocab)
    assert _allowed(bitmask, 1 + len(good), vocab) == set(tokenizer.eos_token_ids)  # then only the end
    rejected_at = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    assert m.fill_bitmasks_for_draft(bitmask, 0, bad) == rejected_at + 1 and m.num_accepted == 0
    assert m.validate(bad) == rejected_at


def test_bitmask_helpers_match_a_plain_unpack():
    vocab = 100
    bitmask = allocate_bitmask(3, vocab)
    bitmask.zero_()
    set_single_token(bitmask, 0, 31)  # bit 31: the int32 sign bit
    set_single_token(bitmask, 2, 64)
    assert _allowed(bitmask, 0, vocab) == {31} and _allowed(bitmask, 2, vocab) == {64}
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits[1], before[1])  # an unlisted row is untouched
    for row, token in ((0, 31), (2, 64)):
        assert logits[row, token] == before[row, token]
        assert torch.isinf(logits[row]).sum() == vocab - 1


# ---- request fields ---------------------------------------------------------------------------------


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


def _error(fn) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == 400
    return e.value


def test_request_fields_map_to_specs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
            StructuredOutputSpec.json(schema),
            "response_format.json_schema.schema",
        ),
        (dict(response_format={"type": "json_object"}), StructuredOutputSpec.json_object(), "response_format"),
        (dict(structured_outputs={"json": schema}), StructuredOutputSpec.json(schema), "structured_outputs.json"),
        (
            dict(structured_outputs={"regex": "a+", "backend": "xgrammar"}),
            StructuredOutputSpec.regex("a+"),
            "structured_outputs.regex",
        ),
        (
            dict(structured_outputs={"choice": ["y", "n"]}),
            StructuredOutputSpec.choice(["y", "n"]),
            "structured_outputs.choice",
        ),
        (
            dict(structured_outputs={"grammar": 'root ::= "a"'}),
            StructuredOutputSpec.grammar('root ::= "a"'),
            "structured_outputs.grammar",
        ),
        (
            dict(structured_outputs={"json_object": True}),
            StructuredOutputSpec.json_object(),
            "structured_outputs.json_object",
        ),
        (dict(guided_json=json.dumps(schema)), StructuredOutputSpec.json(schema), "guided_json"),
        (dict(guided_regex="a+"), StructuredOutputSpec.regex("a+"), "guided_regex"),
        (dict(guided_choice=["y"]), StructuredOutputSpec.choice(["y"]), "guided_choice"),
        (dict(guided_grammar='root ::= "a"'), StructuredOutputSpec.grammar('root ::= "a"'), "guided_grammar"),
    ]
    for fields, spec, param in cases:
        req = _chat(**fields)
        assert req.structured_spec() == (spec, param)
        assert req.sampling_params().structured_output == spec
        completion = parse_body(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())
        assert completion.sampling_params().structured_output == spec
    assert _chat(response_format={"type": "text"}).structured_spec() is None
    assert _chat().sampling_params().structured_output is None


@pytest.mark.parametrize(
    "fields,param,words",
    [
        (
            dict(response_format={"type": "xml"}),
            "response_format.type",
            "must be 'text', 'json_object' or 'json_schema'",
        ),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "must be an object"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
            "is required",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
            "response_format.json_schema.schema",
            "must be a JSON schema",
        ),
        (dict(structured_outputs={}), "structured_outputs", "exactly one of"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "got regex, choice"),
        (dict(structured_outputs={"jsn": {}}), "structured_outputs.jsn", "unknown field"),
        (dict(structured_outputs={"choice": []}), "structured_outputs.choice", "non-empty list"),
        (dict(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object", "must be true"),
        (dict(guided_json="{bad"), "guided_json", "not valid JSON"),
        (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "only one output constraint"),
        (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "only one output constraint"),
    ],
)
def test_request_field_errors(fields, param, words):
    e = _error(lambda: _chat(**fields).sampling_params())
    assert e.param == param and words in e.message, e.to_dict()


def test_tool_fields():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert _chat().tool_mode() == ("none", None)
    assert _chat(tools=[tool]).tool_mode() == ("auto", None)
    assert _chat(tools=[tool], tool_choice="none").tool_mode() == ("none", None)
    assert _chat(tools=[tool], tool_choice="required").tool_mode() == ("required", None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _chat(tools=[tool], tool_choice=named).tool_mode() == ("named", "get_weather")
    for fields, param, words in [
        (dict(tool_choice="required"), "tool_choice", "requires tools"),
        (
            dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "other"}}),
            "tool_choice",
            "not in tools",
        ),
        (dict(tools=[tool, tool]), "tools[1].function.name", "more than one tool"),
        (
            dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
            "tools[0].function.name",
            "letters, digits",
        ),
    ]:
        e = _error(lambda fields=fields: _chat(**fields).tool_mode())
        assert e.param == param and words in e.message, e.to_dict()
    e = _error(lambda: _chat(tools=[{"type": "retrieval"}]))
    assert e.param.startswith("tools[0]")
    e = _error(lambda: _chat(max_reasoning_tokens=-1).sampling_params())
    assert e.param == "max_reasoning_tokens"


def test_tool_messages_are_accepted():
    req = _chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    msgs = req.chat_messages()
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_torch_kernel_used_off_cpu_agrees_with_the_cpu_kernel():
    """Off CPU, apply_bitmask uses xgrammar's pure-torch kernel; both index bitmask rows like logits rows."""
    import xgrammar as xgr

    vocab = 300
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(4, vocab)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, [1, 3])
    xgr.apply_token_bitmask_inplace(b, bitmask, indices=[1, 3], backend="torch_native")
    assert torch.equal(a, b) and torch.equal(a[0], logits[0])
    for row in (1, 3):
        assert set(torch.nonzero(~torch.isinf(a[row])).flatten().tolist()) == _allowed(bitmask, row, vocab)


def test_bench_json_schema_option(tmp_path):
    from tokenmill.bench.cli import _endpoint, build_parser

    path = tmp_path / "person.json"
    path.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--json-schema", str(path), "--extra-body", '{"top_p": 0.5}']
    )
    body = _endpoint(args).payload([{"role": "user", "content": "x"}], 8)
    assert body["top_p"] == 0.5
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    args = build_parser().parse_args(["serve", "--model", "m", "--json-schema", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="--json-schema"):
        _endpoint(args)


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "string", "not": {"const": "a"}}, "'not' (at '/not')"),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"if": {}, "then": {}}]}}},
            "/properties/a/anyOf/1/if",
        ),
        ({"$ref": "http://example.com/schema.json"}, "not a reference within the schema"),
        ({"type": "array", "items": {"$ref": "file:///etc/passwd"}}, "(at '/items/$ref')"),
    ],
)
def test_schema_keywords_the_output_could_not_obey_are_refused(schema, words):
    """The grammar compiler drops `not`, `if` / `then` / `else` and references to other documents without a
    word, so an output would break them: refused, naming the keyword and where it is."""
    with pytest.raises(ValueError, match=re.escape(words)):
        check_spec(StructuredOutputSpec.json(schema))


def test_keyword_names_as_property_names_are_fine():
    check_spec(StructuredOutputSpec.json({"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}))
    check_spec(StructuredOutputSpec.json({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}))
