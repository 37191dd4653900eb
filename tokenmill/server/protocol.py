"""OpenAI request schemas, their validation, and the OpenAI error format.

Bodies are parsed by pydantic in strict JSON mode (a string is not a number, 1 is not `true`);
every failure becomes an `APIError` (HTTP 400) whose message and `param` name the field. Sampling
fields are then checked once more by `SamplingParams`, whose ValueErrors already start with the
field's name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.sampling_params import SamplingParams


class APIError(Exception):
    """An error to send as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ---- request bodies -------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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
    priority: int = 0  # with --scheduling-policy priority: lower values are scheduled first
    cache_salt: str | None = None  # prefix-cache blocks are only shared between requests with the same salt

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it must be unset or equal to n)", "best_of", "unsupported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, renames: dict[str, str]) -> SamplingParams:
        self._check_unsupported()
        kwargs = {"n": self.n, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                  "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "max_tokens": max_tokens,
                  "skip_special_tokens": self.skip_special_tokens, "logprobs": logprobs,
                  "include_stop_str_in_output": self.include_stop_str_in_output}
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        if not -(2**63) <= self.priority < 2**63:
            raise bad_request(f"priority must fit in 64 bits, got {self.priority}", "priority")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad_request(f"seed must fit in 64 bits, got {self.seed}", "seed")
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
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
                message = param + message[len(field):]
            raise bad_request(message, param) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        return self._sampling_params(self.max_tokens, self.logprobs, {})


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    response_format: dict | None = None

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise bad_request("tools are not supported", "tools", "unsupported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format", "unsupported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_completion_tokens is not None:
            max_tokens, renames = self.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
        else:
            max_tokens, renames = self.max_tokens, {}
        renames["logprobs"] = "top_logprobs"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, renames)

    def chat_messages(self) -> list[dict]:
        """Messages as the chat template expects them ('developer' is OpenAI's new name for 'system')."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
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


# ---- parsing ---------------------------------------------------------------------------------------

_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a JSON body; raise a 400 APIError naming the first bad field."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _to_api_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['msg']}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return bad_request("the request body must be a JSON object", None, "invalid_json")
    path = _field_path(err["loc"])
    if kind == "missing":
        return bad_request(f"{path} is required", path, "missing_field")
    last = next((p for p in reversed(path.replace("]", "").replace("[", ".").split(".")) if not p.isdigit()), path)
    message = _UNION_HINTS.get(last) if _is_union_error(e, path) else None
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
