"""What both OpenAI generation endpoints share: the served model, prompt checks against the context
and KV capacity, submitting to the engine client (errors mapped to HTTP statuses), usage and
logprobs in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from tokenmill.engine.outputs import Logprob
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_client import (
    EngineClient,
    EngineDeadError,
    QueueFullError,
    RequestRejected,
    RequestStream,
)
from tokenmill.server.protocol import APIError, bad_request
from tokenmill.structured.spec import StructuredOutputSpec, check_spec
from tokenmill.tokenizer import Tokenizer


def engine_error(e: Exception) -> APIError:
    """The HTTP error for an engine-side failure."""
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "queue_full", {"retry-after": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable", None, "engine_unavailable")
    if isinstance(e, RequestRejected):
        return bad_request(str(e), "prompt", "context_length_exceeded")
    return APIError(500, "internal server error", "internal_server_error", None, None)


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    capacity_tokens: int
    vocab_size: int
    reasoning_parser: str | None = None  # --reasoning-parser: split <think> output into reasoning_content
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def context_limit(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold: the context or the KV pool."""
        return min(self.max_model_len, self.capacity_tokens)

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. This server serves: "
                                f"{', '.join(self.model_names)}.", "invalid_request_error", "model", "model_not_found")
        return name

    async def check_structured(self, spec: StructuredOutputSpec, param: str) -> None:
        """400 naming the problem if the schema / regex / grammar cannot be compiled (checked in a
        worker thread and cached, so the event loop never waits on a large schema)."""
        try:
            await asyncio.to_thread(check_spec, spec)
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"{param} contains token ids outside the vocabulary [0, {self.vocab_size})", param)

    def fit_to_context(self, num_prompt: int, params: SamplingParams, prompt_param: str,
                       max_tokens_param: str = "max_tokens") -> SamplingParams:
        """Check the prompt (and max_tokens) fit; default max_tokens to the room left.
        Returns a copy of params with max_tokens set."""
        limit = self.context_limit
        why = "maximum context length" if limit == self.max_model_len else "KV cache capacity"
        if num_prompt == 0:
            raise bad_request(f"{prompt_param} must contain at least one token", prompt_param)
        if num_prompt >= limit:
            raise bad_request(f"This model's {why} is {limit} tokens, but the {prompt_param} has {num_prompt} "
                              f"tokens (at least one more is needed for the completion). Shorten the "
                              f"{prompt_param}.", prompt_param, "context_length_exceeded")
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=limit - num_prompt)
        if num_prompt + params.max_tokens > limit:
            raise bad_request(f"This model's {why} is {limit} tokens, but {num_prompt + params.max_tokens} "
                              f"were requested ({num_prompt} in the {prompt_param}, {params.max_tokens} for the "
                              f"completion). Lower {max_tokens_param} or shorten the {prompt_param}.",
                              max_tokens_param, "context_length_exceeded")
        return dataclasses.replace(params)

    def submit(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
               arrival: float, priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        try:
            return self.client.generate(request_id, prompt, prompt_ids, params, arrival, priority, cache_salt)
        except (EngineDeadError, QueueFullError) as e:
            raise engine_error(e) from None

    def submit_all(self, prompts: list[tuple[str, str | None, list[int], SamplingParams]], arrival: float,
                   priority: int = 0, cache_salt: str | None = None) -> list[RequestStream]:
        """Submit several prompts; if one cannot be submitted, abort the ones already in."""
        streams: list[RequestStream] = []
        try:
            for request_id, text, ids, params in prompts:
                streams.append(self.submit(request_id, text, ids, params, arrival, priority, cache_salt))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # ---- output formatting --------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                            offset: int) -> tuple[dict, int]:
        """Legacy completions format; returns it and the text offset after these tokens."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, logprobs):
            text = self.token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(entry[tid].logprob) if tid in entry else None)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            out["top_logprobs"].append({self.token_text(t): _finite(lp.logprob) for t, lp in ranked})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def prompt_logprobs_placeholder(self, prompt_ids: list[int], offset: int) -> tuple[dict, int]:
        """Echoed prompt tokens: their text and offsets (prompt logprobs are not computed: null)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid in prompt_ids:
            text = self.token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[dict]:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            top = sorted((kv for kv in entry.items() if kv[1].rank <= top_n), key=lambda kv: kv[1].rank)[:top_n]
            item = self._chat_token(tid, entry[tid].logprob if tid in entry else None)
            item["top_logprobs"] = [self._chat_token(t, lp.logprob) for t, lp in top]
            content.append(item)
        return content

    def _chat_token(self, token_id: int, logprob: float | None) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(x: float | None) -> float | None:
    """JSON has no -inf: clamp like OpenAI does for impossible tokens."""
    if x is None:
        return None
    return max(x, -9999.0)


def merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    for key in a:
        a[key].extend(b[key])
    return a


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
