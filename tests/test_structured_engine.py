"""Constrained decoding through the engine with SmolLM2-135M-Instruct: JSON schemas, regexes, choices and
grammars always produce matching output, in every sampling mode, batched with unconstrained requests,
across preemption, while grammars compile, and after a reasoning budget forces the end of thinking."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import time

import jsonschema
import pytest
from test_server_utils import MODEL, model_available

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore, RequestRejected
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import UniProcExecutor
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import ReasoningSpec, StructuredOutputSpec
from tokenmill.structured.backend import TokenizerData

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

# 20 schemas: nested objects, arrays with min/max items, enums, required fields, bounded numbers, patterns.
# Strings and arrays are bounded so every output can finish within max_tokens.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                },
                "required": ["id", "email"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["price"],
    },
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
        "required": ["date"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 5},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "count": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["version", "count"],
    },
    {
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 1000},
                    {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                ]
            }
        },
        "required": ["id"],
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
            "isbn": {"type": "string", "pattern": "^[0-9]{10}$"},
        },
        "required": ["title", "isbn"],
    },
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        },
        "required": ["grid"],
    },
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", 0, 1, True, None]}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}$"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["id", "flags"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "string", "enum": ["x", "y"]},
                            "d": {"type": "number", "minimum": -1, "maximum": 1},
                        },
                        "required": ["c", "d"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
]

# Bounded arithmetic: at most 3 operators per level and one level of parentheses, so it always ends.
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" inner ")"
inner ::= num (("+" | "-" | "*") num){0,3}
num ::= [1-9] [0-9]{0,2}
"""


@pytest.fixture(scope="module")
def engine():
    # the exact mode: tests compare outputs across batchings and against the exact `default_model`
    config = EngineConfig(
        model=MODEL,
        dtype="float32",
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64),
    )
    return LLMEngine(config)


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(engine, requests: list[tuple[list[int] | str, SamplingParams]], on_step=None) -> list:
    """Run to completion; outputs in request order."""
    base = f"r{id(requests)}-"
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{base}{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step()
    return [done[f"{base}{i}"] for i in range(len(requests))]


def test_twenty_json_schemas_always_validate(engine):
    requests = []
    for i, schema in enumerate(SCHEMAS):
        # half greedy, half sampled (each seeded), in one batch
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, top_p=0.95, seed=i)
        requests.append(
            (
                chat(engine, f"Reply with JSON for this schema: {json.dumps(schema)}"),
                SamplingParams(max_tokens=96, structured_output=StructuredOutputSpec.json(schema), **sampling),
            )
        )
    outputs = run(engine, requests)
    for schema, out in zip(SCHEMAS, outputs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_json_object_and_any_json(engine):
    # any object / any value is unbounded: prompts that invite a short answer, so it ends within max_tokens
    outputs = run(
        engine,
        [
            (
                chat(engine, 'Repeat this JSON exactly: {"cat": "Tom", "age": 3}'),
                SamplingParams(temperature=0, max_tokens=64, structured_output=StructuredOutputSpec.json_object()),
            ),
            (
                chat(engine, "Repeat this JSON exactly: [1, 2, 3]"),
                SamplingParams(temperature=0, max_tokens=64, structured_output=StructuredOutputSpec.json({})),
            ),
        ],
    )
    assert isinstance(json.loads(outputs[0].outputs[0].text), dict), outputs[0].outputs[0].text
    json.loads(outputs[1].outputs[0].text)


SAMPLING_MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=1),
    dict(temperature=1.5, top_k=20, seed=2),
    dict(temperature=1.0, top_p=0.5, seed=3),
    dict(temperature=1.0, min_p=0.1, seed=4),
    dict(temperature=0.8, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, seed=5),
]


def test_regex_choice_and_grammar_always_match(engine):
    cases = [
        (
            StructuredOutputSpec.regex(r"\(\d{3}\) \d{3}-\d{4}"),
            "What is your phone number?",
            lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t),
        ),
        (
            StructuredOutputSpec.regex(r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"),
            "Write an email address.",
            lambda t: re.fullmatch(r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)", t),
        ),
        (
            StructuredOutputSpec.choice(["Positive", "Negative", "Neutral"]),
            "Sentiment of 'I love it'?",
            lambda t: t in ("Positive", "Negative", "Neutral"),
        ),
        (
            StructuredOutputSpec.grammar(ARITHMETIC),
            "Write an arithmetic expression.",
            lambda t: isinstance(ast.parse(t, mode="eval").body, (ast.BinOp, ast.Constant)),
        ),
    ]
    requests, checks = [], []
    for spec, question, check in cases:
        for mode in SAMPLING_MODES:
            requests.append((chat(engine, question), SamplingParams(max_tokens=40, structured_output=spec, **mode)))
            checks.append(check)
    outputs = run(engine, requests)
    for (_, params), check, out in zip(requests, checks, outputs):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and check(o.text), (params, o.text)


def test_constrained_and_unconstrained_batched_together(engine):
    free_prompt = chat(engine, "Tell me about the moon.")
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = run(engine, [(free_prompt, free)])[0].outputs[0].token_ids
    schema = SCHEMAS[0]
    outputs = run(
        engine,
        [
            (
                chat(engine, "A person as JSON."),
                SamplingParams(temperature=0, max_tokens=64, structured_output=StructuredOutputSpec.json(schema)),
            ),
            (free_prompt, free),
            (
                chat(engine, "Yes or no?"),
                SamplingParams(
                    temperature=0, max_tokens=8, structured_output=StructuredOutputSpec.choice(["yes", "no"])
                ),
            ),
        ],
    )
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), schema)
    assert outputs[1].outputs[0].token_ids == alone  # the mask touched only the constrained rows
    assert outputs[2].outputs[0].text in ("yes", "no")


def test_preemption_keeps_constrained_outputs_exact(engine, default_model):
    """A KV pool far too small for the batch preempts requests again and again; their matchers must
    neither skip nor repeat a token, so the outputs equal those of a run with room for all."""
    schemas = [
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": k, "maxItems": k}
        for k in (12, 14, 16, 18, 20, 22)
    ]
    prompts = [chat(engine, "List some numbers.")] + [chat(engine, "Count.") for _ in schemas[1:]]
    params = [
        SamplingParams(temperature=0, max_tokens=96, structured_output=StructuredOutputSpec.json(s)) for s in schemas
    ]
    expected = [o.outputs[0].token_ids for o in run(engine, list(zip(prompts, params)))]

    config = EngineConfig(
        model=MODEL,
        cache=CacheConfig(num_blocks=16, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
    )
    core = EngineCore(
        config,
        UniProcExecutor(config, default_model),
        engine.tokenizer.eos_token_ids,
        TokenizerData.from_tokenizer(engine.tokenizer),
    )
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(str(i), p, sp))
    got = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            got[o.request_id].extend(o.new_token_ids)
    assert core.scheduler.num_preemptions >= 3
    assert [got[str(i)] for i in range(len(prompts))] == expected
    for schema, ids in zip(schemas, expected):
        jsonschema.validate(json.loads(engine.tokenizer.decode(ids)), schema)


def _compile_workers(compiler, replacing: list | None = None) -> list:
    """The grammar compiler's worker processes, once they are up (and one of `replacing` was replaced)."""
    deadline = time.monotonic() + 120
    while True:
        procs = list(compiler._workers.processes)
        up = all(p is not None and p.is_alive() for p in procs)
        if up and (replacing is None or {p.pid for p in procs} != {p.pid for p in replacing}):
            return procs
        assert time.monotonic() < deadline, "grammar workers did not start"
        time.sleep(0.1)


def test_compiling_grammar_does_not_block_other_requests(engine):
    """The grammar workers are stopped (SIGSTOP: a compile that hangs); unconstrained requests run on."""
    core = engine.core
    workers = _compile_workers(core.structured.compiler)
    for p in workers:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        schema = {
            "type": "object",
            "properties": {"compiled_late": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["compiled_late"],
        }
        engine.add_request(
            "slow",
            chat(engine, "JSON please."),
            SamplingParams(temperature=0, max_tokens=32, structured_output=StructuredOutputSpec.json(schema)),
        )
        engine.add_request("free", chat(engine, "Hello!"), SamplingParams(temperature=0, max_tokens=4))
        engine.add_request(
            "aborted",
            chat(engine, "JSON please."),
            SamplingParams(
                max_tokens=8,
                structured_output=StructuredOutputSpec.json(
                    {"type": "object", "properties": {"never_compiled": {"type": "null"}}}
                ),
            ),
        )
        assert [r.request_id for r in core.compiling] == ["slow", "aborted"]
        assert core.stats().num_waiting == 3
        engine.abort_request("aborted")
        finished = {}
        while "free" not in finished:  # the unconstrained request runs to the end meanwhile
            for out in engine.step():
                finished[out.request_id] = out
        assert "slow" not in finished and [r.request_id for r in core.compiling] == ["slow"]
    finally:
        for p in workers:
            os.kill(p.pid, signal.SIGCONT)
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert json.loads(finished["slow"].outputs[0].text)["compiled_late"] in range(10)
    assert "aborted" not in finished and not core.compiling


def test_a_grammar_past_its_deadline_is_refused_and_its_worker_replaced(engine):
    """Every compile hangs (workers stopped); with a 1 s deadline the request fails as the client's
    fault, the worker that ran it is killed and replaced, and grammars compile again afterwards."""
    compiler = engine.core.structured.compiler
    workers = compiler._workers
    old = _compile_workers(compiler)
    saved, workers.timeout = workers.timeout, 1.0
    for p in old:
        os.kill(p.pid, signal.SIGSTOP)
    schema = {"type": "object", "properties": {"deadline_test": {"type": "boolean"}}, "required": ["deadline_test"]}
    params = SamplingParams(temperature=0, max_tokens=24, structured_output=StructuredOutputSpec.json(schema))
    try:
        engine.add_request("stuck", chat(engine, "JSON please."), params)
        finished = run_until(engine, "stuck")
    finally:
        workers.timeout = saved
        for p in old:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
    out = finished["stuck"].outputs[0]
    assert out.finish_reason == "abort" and "longer than 1 s" in out.error and out.error_param == "structured_output"
    assert sorted(p.exitcode or 0 for p in old) == [-signal.SIGKILL, 0]  # the one that ran it was killed
    _compile_workers(compiler, replacing=old)  # and replaced
    with pytest.raises(ValueError, match="longer than 1 s"):  # a timed-out grammar is refused at once
        engine.add_request("again", chat(engine, "JSON please."), params)
    schema["properties"]["after"] = {"type": "integer"}
    engine.add_request(
        "fine",
        chat(engine, "JSON please."),
        SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutputSpec.json(schema)),
    )
    assert json.loads(run_until(engine, "fine")["fine"].outputs[0].text)["deadline_test"] in (True, False)


def run_until(engine, request_id: str) -> dict:
    finished = {}
    while request_id not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_reasoning_budget_forces_the_end_then_constrains(engine):
    tok = engine.tokenizer
    end_ids = tuple(tok.encode("</think>", add_special_tokens=False))
    schema = SCHEMAS[1]
    budget = 5
    reasoning = ReasoningSpec("</think>", end_ids, in_reasoning=True, budget=budget)
    outputs = run(
        engine,
        [
            (
                chat(engine, "Pick a color."),
                SamplingParams(
                    temperature=0,
                    max_tokens=48,
                    reasoning=reasoning,
                    structured_output=StructuredOutputSpec.json(schema),
                ),
            ),
            (chat(engine, "Pick a color."), SamplingParams(temperature=0, max_tokens=12, reasoning=reasoning)),
            (
                chat(engine, "Pick a color."),  # the prompt closed the thinking: constrained from the first token
                SamplingParams(
                    temperature=0,
                    max_tokens=48,
                    structured_output=StructuredOutputSpec.json(schema),
                    reasoning=ReasoningSpec("</think>", end_ids, in_reasoning=False),
                ),
            ),
        ],
    )
    ids = outputs[0].outputs[0].token_ids
    assert tuple(ids[budget : budget + len(end_ids)]) == end_ids  # forced right after the budget
    jsonschema.validate(json.loads(tok.decode(ids[budget + len(end_ids) :])), schema)
    assert tuple(outputs[1].outputs[0].token_ids[budget : budget + len(end_ids)]) == end_ids
    assert len(outputs[1].outputs[0].token_ids) == 12  # unconstrained after the thinking
    jsonschema.validate(json.loads(outputs[2].outputs[0].text), schema)


def test_stop_conditions_still_apply(engine):
    spec = StructuredOutputSpec.json(SCHEMAS[0])
    outputs = run(
        engine,
        [
            (
                chat(engine, "A person as JSON."),
                SamplingParams(temperature=0, max_tokens=64, structured_output=spec, stop=['"age"']),
            ),
            (chat(engine, "A person as JSON."), SamplingParams(temperature=0, max_tokens=5, structured_output=spec)),
            (
                chat(engine, "Yes or no?"),
                SamplingParams(
                    temperature=0,
                    max_tokens=8,
                    min_tokens=6,
                    structured_output=StructuredOutputSpec.choice(["yes", "no"]),
                ),
            ),
            (
                chat(engine, "Yes or no?"),
                SamplingParams(
                    temperature=0,
                    max_tokens=8,
                    ignore_eos=True,
                    structured_output=StructuredOutputSpec.choice(["yes", "no"]),
                ),
            ),
            (
                chat(engine, "A person as JSON."),
                SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=64, structured_output=spec),
            ),
        ],
    )
    stopped = outputs[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"' and '"age"' not in stopped.text
    cut = outputs[1].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and cut.text.startswith("{")
    for out in outputs[2:4]:  # the grammar decides the end (min_tokens and ignore_eos give way to it)
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    for o in outputs[4].outputs:
        jsonschema.validate(json.loads(o.text), SCHEMAS[0])


def test_invalid_specs_are_rejected(engine, default_model):
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request("bad", "x", SamplingParams(structured_output=StructuredOutputSpec.regex("(a")))
    assert not engine.has_unfinished_requests()
    bare_config = EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=16))
    bare = EngineCore(bare_config, UniProcExecutor(bare_config, default_model), {2})
    with pytest.raises(RequestRejected, match="structured output is not available"):
        bare.add_request(
            EngineCoreRequest("x", [1, 2], SamplingParams(structured_output=StructuredOutputSpec.regex("a")))
        )


def test_speculation_keeps_constrained_outputs_exact_and_valid(engine, default_model):
    """n-gram drafts for constrained requests: cut where the grammar rejects them, every verified
    position masked by the grammar after the drafts before it; the same tokens as without
    speculation (which the module's engine runs), outputs that validate, accepted drafts, a whole pool."""
    from tokenmill.config import SpeculativeConfig

    schema = {
        "type": "array",
        "minItems": 6,
        "maxItems": 6,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": ["ann", "bob"]}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
        },
    }
    prompts = [chat(engine, "Give me six people."), chat(engine, "Six records, please."), chat(engine, "Hello!")]
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutputSpec.json(schema)),
        SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutputSpec.regex(r"(ab|cd){3,12}\.")),
        SamplingParams(temperature=0, max_tokens=40),
    ]
    expected = [o.outputs[0].token_ids for o in run(engine, list(zip(prompts, params)))]

    config = EngineConfig(
        model=MODEL,
        cache=CacheConfig(num_blocks=256),
        speculative=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8, min_acceptance=0.0),
    )
    core = EngineCore(
        config,
        UniProcExecutor(config, default_model),
        engine.tokenizer.eos_token_ids,
        TokenizerData.from_tokenizer(engine.tokenizer),
    )
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(str(i), p, sp))
    got, drafted = {str(i): [] for i in range(len(prompts))}, set()
    while core.has_unfinished():
        for o in core.step():
            got[o.request_id].extend(o.new_token_ids)
        drafted.update(core.last_schedule.spec_token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert {"0", "1"} <= drafted and core.scheduler.spec_stats.num_accepted_tokens > 0
    jsonschema.validate(json.loads(engine.tokenizer.decode(expected[0])), schema)
    assert re.fullmatch(r"(ab|cd){3,12}\.", engine.tokenizer.decode(expected[1]))
    assert core.kv.num_free_blocks == core.kv.num_blocks
    sampled = SamplingParams(
        temperature=0.9, seed=3, max_tokens=60, structured_output=StructuredOutputSpec.regex(r"(ab|cd){3,12}\.")
    )
    for i in range(3):  # sampling: rejection-sampled against the masked distribution, still valid
        core.add_request(EngineCoreRequest(f"s{i}", prompts[1], sampled))
    out = {f"s{i}": [] for i in range(3)}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert len({tuple(v) for v in out.values()}) == 1  # one seed, one output
    assert re.fullmatch(r"(ab|cd){3,12}\.", engine.tokenizer.decode(out["s0"]))
    assert core.kv.num_free_blocks == core.kv.num_blocks
