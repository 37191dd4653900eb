"""OpenAI request schemas, their validation, and the OpenAI error format.

Bodies are parsed by pydantic in strict JSON mode (a string is not a number, 1 is not `true`);
every failure becomes an `APIError` (HTTP 400) whose message and `param` name the field. Sampling
fields are then checked once more by `SamplingParams`, whose ValueErrors already start with the
field's name.

Output constraints (both endpoints; at most one per request): OpenAI `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema"}}`), vLLM's
`structured_outputs` (`{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": EBNF}`,
`{"json_object": true}`) and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. Chat also takes `tools`, `tool_choice` (none / auto / required / a named function),
`parallel_tool_calls`, `role: "tool"` messages and assistant `tool_calls`, `chat_template_kwargs`, and,
on a server started with `--reasoning-parser`, `max_reasoning_tokens` (the most tokens the model may
think for before "</think>" is forced).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenmill.http_front import APIError, bad_request
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.limits import CHAT_TEMPLATE_KWARGS
from tokenmill.structured.spec import StructuredOutputSpec

# ---- request bodies -------------------------------------------------------------------------------


MAX_TRANSFER_ID = 256  # characters: a store key the decode server asks the producer for until it comes


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI clients send `null` for fields they leave unset (n, stream, logprobs, ...): for a field
        that cannot be None, null means its default; a nullable one (max_tokens) keeps None."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or type(None) in get_args(fields[k].annotation)
        }


# a request's scheduling priority (with --scheduling-policy priority: lower values are scheduled first)
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    priority: Priority = 0
    prompt_logprobs: int | None = None  # vLLM: logprobs (top-N) of every prompt token, in the response
    cache_salt: str | None = None  # prefix-cache blocks are only shared between requests with the same salt
    speculative: bool = True  # false: no drafted tokens for this request (when the server speculates)
    # disaggregated prefill/decode (vLLM's name; set by `tokenmill disagg-proxy`): {"transfer_id": "..."}
    kv_transfer_params: dict | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older guided_* names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: the backend is always xgrammar

    def _check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it must be unset or equal to n)", "best_of", "unsupported")

    def _kv_transfer_id(self) -> str:
        transfer_id = self.kv_transfer_params.get("transfer_id")
        if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID:
            raise bad_request(
                f"kv_transfer_params.transfer_id must be a non-empty string of at most {MAX_TRANSFER_ID} characters",
                "kv_transfer_params",
            )
        if self.n != 1:
            raise bad_request("kv_transfer_params needs n = 1 (one sequence per transfer)", "n")
        return transfer_id

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_spec(self) -> tuple[StructuredOutputSpec, str] | None:
        """The requested output constraint and the field it came from (not yet validated: see
        `check_spec`), or None. At most one of response_format (non-text), structured_outputs and
        guided_* may be set."""
        found: list[tuple[StructuredOutputSpec, str]] = []
        rf = self.response_format
        if rf is not None:
            spec = _response_format_spec(rf)
            if spec is not None:
                found.append(spec)
        if self.structured_outputs is not None:
            found.append(_structured_outputs_spec(self.structured_outputs))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((_make_spec(kind, value, name), name))
        if len(found) > 1:
            raise bad_request(
                f"only one output constraint may be given, got {', '.join(p for _, p in found)}", found[1][1]
            )
        return found[0] if found else None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's {"token id as a string": bias in [-100, 100]}, keyed by the ids (a 400 for a key that
        is not one); the only place its keys are parsed."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:  # ASCII only: str.isdigit() and int() also take other scripts' digits ("²" is a digit, no int)
                token = int(key) if key.isascii() else -1
            except ValueError:
                token = -1
            if token < 0:
                raise bad_request(
                    f"logit_bias keys must be token ids (decimal integers >= 0), got {key[:40]!r}", "logit_bias"
                )
            bias[token] = value
        return bias

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        renames: dict[str, str],
        structured_output: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        self._check_unsupported()
        kwargs = {
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "max_tokens": max_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_output": structured_output,
            "logit_bias": self.logit_bias_ids(),
            "prompt_logprobs": prompt_logprobs,
            "speculative": self.speculative,
        }
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is allowed only with stream: true", "stream_options")
        if self.kv_transfer_params is not None:
            kwargs["kv_transfer_id"] = self._kv_transfer_id()
            if prompt_logprobs is not None:  # the decode server takes the prompt's KV, never its logits
                param = "prompt_logprobs" if self.prompt_logprobs is not None else "echo"
                raise bad_request(
                    f"{param}: the prompt's logprobs cannot come with kv_transfer_params (disaggregated "
                    "prefill: the decode server does not compute the prompt)",
                    param,
                    "unsupported",
                )
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:  # null means "the default"
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e)
            field = message.split(" ", 1)[0]
            param = renames.get(field, field)
            if param != field:
                message = param + message[len(field) :]
            raise bad_request(message, param) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo (or prompt_logprobs): score the prompt, generate nothing
    logprobs: int | None = None  # with echo, also for the echoed prompt tokens
    echo: bool = False
    suffix: str | None = None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes for the prompt: vLLM's prompt_logprobs, or OpenAI's echo + logprobs
        (echo with max_tokens 0 scores the prompt even without logprobs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return self.logprobs or 0
        return None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        spec = self.structured_spec()
        return self._sampling_params(
            self.max_tokens, self.logprobs, {}, spec[0] if spec else None, self.engine_prompt_logprobs
        )


class TextPart(_Body):
    type: Literal["text"]
    text: str


# the id of a tool call that the client sends back with its result (Anthropic's tool_use / tool_result,
# the Responses API's function_call / function_call_output): it pairs the two, so never empty, and short
CallId = Annotated[str, Field(min_length=1, max_length=256)]


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": which call this result answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (not sent back to the model)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # template switches (limits.CHAT_TEMPLATE_KWARGS), e.g. enable_thinking
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # with --reasoning-parser: most tokens the model may think for; then "</think>" is forced
    max_reasoning_tokens: int | None = None

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function). Checks tools and tool_choice."""
        tools = self.tools or []
        names = [t.function.name for t in tools]
        for i, name in enumerate(names):
            if not _FUNCTION_NAME.match(name):
                raise bad_request(
                    f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                    f"tools[{i}].function.name",
                )
            if name in names[:i]:
                raise bad_request(
                    f"tools[{i}].function.name {name!r} is used by more than one tool", f"tools[{i}].function.name"
                )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice names function {choice.function.name!r}, which is not in tools", "tool_choice"
                )
            return "named", choice.function.name
        if choice is None:
            return ("auto" if tools else "none"), None
        if choice in ("auto", "required") and not tools:
            raise bad_request(f"tool_choice {choice!r} requires tools", "tool_choice")
        return choice, None

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, checked: only the documented switches, with scalar values."""
        kwargs = self.chat_template_kwargs or {}
        for key, value in kwargs.items():
            param = f"chat_template_kwargs.{key}"
            if key not in CHAT_TEMPLATE_KWARGS:
                raise bad_request(
                    f"{param} is not allowed; chat_template_kwargs may set {', '.join(CHAT_TEMPLATE_KWARGS)}",
                    param,
                    "unsupported",
                )
            if not isinstance(value, (bool, int, float, str)) or (isinstance(value, str) and len(value) > 64):
                raise bad_request(f"{param} must be a boolean, a number or a short string", param)
        return kwargs

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_completion_tokens is not None:
            max_tokens, renames = self.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
        else:
            max_tokens, renames = self.max_tokens, {}
        renames["logprobs"] = "top_logprobs"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_reasoning_tokens is not None and self.max_reasoning_tokens < 0:
            raise bad_request(
                f"max_reasoning_tokens must be an int >= 0, got {self.max_reasoning_tokens}", "max_reasoning_tokens"
            )
        spec = self.structured_spec()
        return self._sampling_params(max_tokens, logprobs, renames, spec[0] if spec else None, self.prompt_logprobs)

    def chat_messages(self) -> list[dict]:
        """Messages as the chat template expects them ('developer' is OpenAI's new name for 'system'),
        with tool calls and tool results where present."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg = {"role": role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only: keep the leading features
    user: str | None = None
    priority: Priority = 0


# a LoRA adapter's name: what requests give as their `model`, listed by /v1/models and named in errors
LoRAName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


class LoadLoRAAdapterRequest(_Body):
    lora_name: LoRAName
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: LoRAName


# ---- structured output fields ------------------------------------------------------------------------

_STRUCTURED_KEYS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# vLLM options without an effect here (xgrammar is the only backend; JSON output is always compact)
_IGNORED_STRUCTURED_KEYS = {
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
}


def _make_spec(kind: str, value, param: str) -> StructuredOutputSpec:
    try:
        if kind == "json":
            if not isinstance(value, (dict, str)):
                raise ValueError("must be a JSON schema (an object, or its JSON text)")
            return StructuredOutputSpec.json(value)
        if kind == "json_object":
            if value is not True:
                raise ValueError("must be true")
            return StructuredOutputSpec.json_object()
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("must be a non-empty list of non-empty strings")
            return StructuredOutputSpec.choice(value)
        if not isinstance(value, str) or not value:
            raise ValueError("must be a non-empty string")
        return StructuredOutputSpec(kind, value)
    except ValueError as e:
        message = str(e)
        raise bad_request(
            f"{param} {message}" if message.startswith("must") else f"{param}: {message}", param
        ) from None


def _response_format_spec(rf: dict) -> tuple[StructuredOutputSpec, str] | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object(), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a 'schema'", "response_format.json_schema"
            )
        if "schema" not in js:
            raise bad_request(
                "response_format.json_schema.schema is required", "response_format.json_schema.schema", "missing_field"
            )
        param = "response_format.json_schema.schema"
        return _make_spec("json", js["schema"], param), param
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


def _structured_outputs_spec(so: dict) -> tuple[StructuredOutputSpec, str]:
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS) - _IGNORED_STRUCTURED_KEYS)
    if unknown:
        raise bad_request(
            f"structured_outputs has unknown field(s) {', '.join(unknown)}; use one of {', '.join(_STRUCTURED_KEYS)}",
            f"structured_outputs.{unknown[0]}",
        )
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}"
            + (f", got {', '.join(given)}" if given else ""),
            "structured_outputs",
        )
    param = f"structured_outputs.{given[0]}"
    return _make_spec(_STRUCTURED_KEYS[given[0]], so[given[0]], param), param


# ---- parsing ---------------------------------------------------------------------------------------

_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}
# an item's field whose error deserves more words than pydantic's
_ITEM_HINTS = {
    ("content", "type"): "this server takes text only: a content part's type must be 'text'",
}


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a JSON body; raise a 400 APIError naming the first bad field."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise _to_api_error(e) from None


def parse_part(model: type[BaseModel], data, path: str) -> BaseModel:
    """Validate one part of a parsed body (e.g. an item of a list whose `type` says which model it is);
    a 400 naming the field under `path`."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise _to_api_error(e, path) from None


def parse_tagged(models: dict[str, type[BaseModel]], kind, data, path: str) -> BaseModel:
    """`data` validated as the model its `type` (`kind`) names in `models` (a list item of the Anthropic
    or Responses API); a 400 naming `path.type` when `models` has no such type."""
    if not isinstance(kind, str) or kind not in models:  # (a list or an object is not even hashable)
        raise bad_request(
            f"{path}.type must be one of {', '.join(models)}, got {str(kind)[:40]!r}", f"{path}.type", "unsupported"
        )
    return parse_part(models[kind], data, path)


def renamed(e: APIError, renames: tuple[tuple[str, str], ...]) -> APIError:
    """`e` with the chat field it names (param, and in the message) written as another API calls it:
    `renames` are (regex matching the start of a chat field name, its replacement); the first wins."""
    for pattern, replacement in renames:
        m = re.match(pattern, e.param or "")
        if m:
            old, new = m.group(0), m.expand(replacement)
            e.param = new + e.param[len(old) :]
            e.message = e.message.replace(old, new)
            break
    return e


def _to_api_error(e: ValidationError, prefix: str = "") -> APIError:
    errors = e.errors(include_url=False)
    err = errors[0]
    # a union whose first member's error is the field as a whole (content: "a valid string") while a list
    # member got further, into an item (content[0].type: "'text'"): the item's error says what is wrong
    at = _field_path(err["loc"])
    err = next((x for x in errors if _field_path(x["loc"]).startswith(at + "[")), err)
    kind = err["type"]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['msg']}", None, "invalid_json")
    if kind == "model_type" and not err["loc"] and not prefix:
        return bad_request("the request body must be a JSON object", None, "invalid_json")
    local = path = _field_path(err["loc"])
    if prefix:  # a part of the body: its path under the part's
        path = prefix if local == "body" else prefix + ("" if local[0] == "[" else ".") + local
    if kind == "missing":
        return bad_request(f"{path} is required", path, "missing_field")
    last = next((p for p in reversed(path.replace("]", "").replace("[", ".").split(".")) if not p.isdigit()), path)
    message = _UNION_HINTS.get(last) if _is_union_error(e, local) else None
    names = [p for p in path.replace("]", "").replace("[", ".").split(".") if not p.isdigit()]
    message = message or (_ITEM_HINTS.get(tuple(names[-2:])) if kind == "literal_error" else None)
    return bad_request(f"{path}: {message or err['msg']}" + _got(err), path)


def _is_union_error(e: ValidationError, path: str) -> bool:
    """Several errors at the same field (one per union member) mean 'none of the types fit'."""
    return sum(1 for x in e.errors() if _field_path(x["loc"]) == path) > 1


def _field_path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.isidentifier() and item not in ("str", "int", "float", "bool", "list", "dict") and "[" not in item:
            if item[0].isupper():  # a model class name from a union branch
                continue
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "body"


def _got(err: dict) -> str:
    value = err.get("input")
    if isinstance(value, (dict, list)) or value is None:
        return ""
    text = repr(value)
    return f", got {text[:60]}"
