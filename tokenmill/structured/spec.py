"""What a request asks to be constrained to, and the cheap check that the ask is valid.

`StructuredOutputSpec` is a small frozen value (kind + payload) that travels on `SamplingParams` to the
engine core; `spec.key` (a sha256 of kind and payload) keys the compiled-grammar cache.
`ReasoningSpec` tells the core where a reasoning model's thinking ends (constraints start after it) and
optionally caps the thinking.

`check_spec(spec)` raises ValueError with a readable reason for an invalid schema, regex or grammar. It
builds the xgrammar `Grammar` (no tokenizer work, so it is fast) and, for JSON schemas, checks the schema
against its meta-schema first; results are cached by spec.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# JSON output is compact (json.dumps style: ", " and ": ", no newlines). Allowing any whitespace lets a
# small model emit whitespace forever instead of closing the value; compact output is still valid JSON.
JSON_ANY_WHITESPACE = False


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One output constraint.

    kind          value
    ``json``        a JSON schema, as compact JSON text (property order kept: it is the output's order)
    ``json_object`` None: any JSON object
    ``regex``       a regular expression the whole output must match
    ``choice``      a tuple of strings; the output is exactly one of them
    ``grammar``     an EBNF grammar (GBNF / llama.cpp syntax) with a ``root`` rule

    Build with the class methods (`StructuredOutputSpec.json(schema)`, `.regex(...)`, ...).
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.value is not None:
                raise ValueError("structured_output of kind json_object takes no value")
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.value):
                raise ValueError("choice must be a list of non-empty strings")
        elif not isinstance(self.value, str) or not self.value:
            raise ValueError(f"{self.kind} must be a non-empty string")

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def json(cls, schema: dict | str) -> StructuredOutputSpec:
        """A JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        return cls("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices) -> StructuredOutputSpec:
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
            raise ValueError("choice must be a non-empty list of strings")
        return cls("choice", tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputSpec:
        return cls("grammar", ebnf)

    # ---- derived ------------------------------------------------------------------------------

    @functools.cached_property
    def key(self) -> str:
        """Cache key: sha256 of kind and payload."""
        payload = json.dumps(list(self.value)) if isinstance(self.value, tuple) else (self.value or "")
        return hashlib.sha256(f"{self.kind}\0{payload}".encode()).hexdigest()

    @property
    def schema(self) -> dict | None:
        """The JSON schema of a ``json``/``json_object`` spec (a dict), else None."""
        if self.kind == "json":
            return json.loads(self.value)
        if self.kind == "json_object":
            return {"type": "object"}
        return None

    def __repr__(self) -> str:
        value = repr(self.value)
        return f"StructuredOutputSpec({self.kind}, {value[:80] + '...' if len(value) > 80 else value})"


@dataclass(frozen=True)
class ReasoningSpec:
    """How a reasoning model's thinking looks to the engine core.

    The core watches the generated bytes for `end` ("</think>"); output constraints apply only after it.
    `in_reasoning` False means the prompt already closed the thinking (e.g. Qwen3 with thinking off), so
    constraints apply from the first token. With `budget` set, once that many tokens were generated
    inside the thinking, the core forces `end_token_ids` (the tokens of `end`) one per step.
    """

    end: str = "</think>"
    end_token_ids: tuple[int, ...] = ()
    in_reasoning: bool = True
    budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.end, str) or not self.end:
            raise ValueError("reasoning end marker must be a non-empty string")
        if self.budget is not None:
            if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 0:
                raise ValueError(f"reasoning budget must be an int >= 0, got {self.budget!r}")
            if not self.end_token_ids:
                raise ValueError("a reasoning budget needs end_token_ids (the tokens to force)")


# ---- grammar construction and validation --------------------------------------------------------

MAX_SCHEMA_DEPTH = 64  # objects/arrays inside each other; deeper schemas are refused (no recursion limits hit)


def _depth(value) -> int:
    """How deeply dicts and lists nest in `value` (iterative: any depth is safe to measure)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def clean_error(e: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp and source location: keep the message."""
    text = str(e).strip()
    text = _XGR_PREFIX.sub("", text)
    return text.splitlines()[0] if text else type(e).__name__


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: StructuredOutputSpec):
    """The xgrammar `Grammar` of a spec (tokenizer independent). Raises ValueError on a bad spec."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type":"object"}', any_whitespace=JSON_ANY_WHITESPACE)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.value))
        return xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{_WHAT[spec.kind]}: {clean_error(e)}") from None


_WHAT = {
    "json": "invalid JSON schema",
    "json_object": "invalid JSON object grammar",
    "regex": "invalid regex",
    "choice": "invalid choice",
    "grammar": "invalid grammar",
}


@functools.lru_cache(maxsize=512)
def _check(spec: StructuredOutputSpec) -> None:
    if spec.kind == "json":
        _check_json_schema(json.loads(spec.value))
    build_grammar(spec)


def check_spec(spec: StructuredOutputSpec) -> None:
    """Raise ValueError naming the problem if `spec` cannot be compiled (cached per spec)."""
    _check(spec)


# Where a schema holds other schemas: maps of them, lists of them, one of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
# keywords the grammar compiler drops without a word: an output that obeys the rest might not obey them
_UNENFORCED = ("not", "if", "then", "else")


def _check_enforceable(schema, where: str = "") -> None:
    """A ValueError naming the first keyword of `schema` whose constraint the output would not obey (the
    compiler drops it), or a `$ref` to anything but this schema's own parts ("#..."): no document is
    fetched, and a reference to one would constrain nothing."""
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in _UNENFORCED:
            if key in node:
                raise ValueError(f"'{key}' (at '{at}/{key}') is a constraint structured output cannot enforce")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise ValueError(f"$ref {ref[:80]!r} (at '{at}/$ref') is not a reference within the schema ('#/...')")
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{at}/{key}/{name}") for name, sub in node[key].items())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{at}/{key}/{i}") for i, sub in enumerate(node[key]))
        stack.extend((node[key], f"{at}/{key}") for key in _SCHEMA_ONES if key in node)


def _check_json_schema(schema: dict) -> None:
    """Meta-schema check, when `jsonschema` is installed (it gives the clearest messages; without it
    xgrammar's own conversion still rejects what it cannot handle); then what the output could not obey."""
    _check_enforceable(schema)
    try:
        import jsonschema
    except ImportError:
        return

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"invalid JSON schema: {e.message}" + (f" (at '{where}')" if where else "")) from None
