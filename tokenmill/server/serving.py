"""What both OpenAI generation endpoints share: the served model, prompt checks against the context
and KV capacity, submitting to the engine client (errors mapped to HTTP statuses), usage and
logprobs in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.requests import Request

from tokenmill.asgi import ClientDisconnected, run_until_disconnect
from tokenmill.engine.outputs import Logprob
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.limits import RequestLimits
from tokenmill.server.protocol import APIError, bad_request
from tokenmill.server.request_stream import (
    EngineDeadError,
    QueueFullError,
    RequestFailed,
    RequestRejected,
    RequestStream,
    RequestTimeout,
)
from tokenmill.structured.spec import StructuredOutputSpec, check_spec
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# what a submitted request's stream may raise instead of an output
ENGINE_ERRORS = (EngineDeadError, RequestRejected, RequestFailed, RequestTimeout)


def engine_error(e: Exception, structured_param: str | None = None) -> APIError:
    """The HTTP error for an engine-side failure. `structured_param`: the request field the output
    constraint came from (a grammar the engine refused is that field's fault)."""
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "queue_full", {"retry-after": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable", None, "engine_unavailable", {"retry-after": "5"})
    if isinstance(e, RequestTimeout):
        return APIError(504, str(e), "timeout_error", None, "request_timeout")
    if isinstance(e, RequestRejected):
        param = structured_param if e.param == "structured_output" and structured_param else e.param
        return bad_request(str(e), param, e.code)
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), "internal_server_error", None, "engine_request_failed")
    return APIError(500, "internal server error", "internal_server_error", None, None)


async def wait_started(streams: list[RequestStream], structured_param: str | None, request: Request) -> None:
    """For a request with an output constraint: wait until the engine took it (its grammar compiled:
    the first output came) before a streamed response starts, so a refused grammar is still a 400. A client
    that leaves meanwhile has its requests aborted at once (a grammar may take seconds to compile, and the
    requests queued behind it wait)."""
    if structured_param is None:
        return

    async def all_started() -> None:
        for s in streams:
            await s.started()

    try:
        await run_until_disconnect(request, all_started())
    except (ClientDisconnected, *ENGINE_ERRORS) as e:
        for s in streams:
            s.close()
        if isinstance(e, ClientDisconnected):
            raise APIError(499, "the client closed the connection", "client_closed_request") from None
        raise engine_error(e, structured_param) from None


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    capacity_tokens: int
    vocab_size: int
    reasoning_parser: str | None = None  # --reasoning-parser: split <think> output into reasoning_content
    limits: RequestLimits = field(default_factory=RequestLimits)
    loras: dict[str, str] | None = (
        None  # LoRA adapters served (name -> path), a request's model may name one; None: off
    )
    _token_text: dict[int, str] = field(default_factory=dict)
    # chat templates and tokenization run here, off the event loop, under limits.template_timeout
    _prompt_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenmill-prompt")
    )

    async def off_loop(self, param: str, fn, *args):
        """Run `fn(*args)` (template rendering, tokenization) in the prompt pool; a 400 naming `param`
        if it takes longer than --template-timeout once it runs (the time it waits for a thread of the pool,
        behind other requests' work, is not its own)."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def job():
            loop.call_soon_threadsafe(started.set)
            return fn(*args)

        future = loop.run_in_executor(self._prompt_pool, job)
        waiting = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait((future, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        try:
            return await asyncio.wait_for(future, self.limits.template_timeout)
        except TimeoutError:
            raise bad_request(
                f"{param}: preparing the prompt took longer than {self.limits.template_timeout:g} s", param, "timeout"
            ) from None

    def check_limits(self, req, num_prompts: int = 1) -> None:
        """The request's fan-out and list sizes against --max-n, --max-stop, ... (before any work)."""
        lim = self.limits
        if req.n > lim.max_n:
            raise bad_request(f"n must be <= {lim.max_n}, got {req.n}", "n")
        if num_prompts > lim.max_prompts:
            raise bad_request(f"prompt has {num_prompts} prompts; at most {lim.max_prompts} are allowed", "prompt")
        if num_prompts > 1 and getattr(req, "kv_transfer_params", None) is not None:
            raise bad_request("kv_transfer_params needs a single prompt (one sequence per transfer)", "prompt")
        if req.n * num_prompts > lim.max_choices:
            raise bad_request(
                f"n x prompts = {req.n * num_prompts} sequences; at most {lim.max_choices} per request", "n"
            )
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > lim.max_stop:
            raise bad_request(f"stop has {len(stops)} strings; at most {lim.max_stop} are allowed", "stop")
        if any(len(s) > lim.max_stop_length for s in stops):
            raise bad_request(f"stop strings must be at most {lim.max_stop_length} characters", "stop")
        stop_ids = req.stop_token_ids or []
        if len(stop_ids) > lim.max_stop_token_ids:
            raise bad_request(
                f"stop_token_ids has {len(stop_ids)} ids; at most {lim.max_stop_token_ids} are allowed",
                "stop_token_ids",
            )
        self.check_token_ids(stop_ids, "stop_token_ids")
        bias = req.logit_bias or {}
        if len(bias) > lim.max_logit_bias:
            raise bad_request(
                f"logit_bias has {len(bias)} entries; at most {lim.max_logit_bias} are allowed", "logit_bias"
            )
        self.check_token_ids(list(req.logit_bias_ids() or ()), "logit_bias")
        tools = getattr(req, "tools", None) or []
        if len(tools) > lim.max_tools:
            raise bad_request(f"tools has {len(tools)} entries; at most {lim.max_tools} are allowed", "tools")
        queue = self.client.max_queue
        if queue is not None and req.n * num_prompts > queue:
            raise bad_request(
                f"n x prompts = {req.n * num_prompts} sequences can never fit the server's queue of {queue}", "n"
            )

    @property
    def context_limit(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold: the context or the KV pool."""
        return min(self.max_model_len, self.capacity_tokens)

    def check_model(self, name: str | None) -> str:
        """The model name to answer with (a LoRA adapter's too); 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.model_names[0]
        if name not in self.model_names and name not in (self.loras or {}):
            served = [*self.model_names, *(self.loras or {})]
            raise APIError(
                404,
                f"The model `{name}` does not exist. This server serves: {', '.join(served)}.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return name

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter a request for `model` (a name `check_model` returned) runs, or None."""
        return model if model in (self.loras or {}) else None

    async def check_structured(self, spec: StructuredOutputSpec, param: str) -> None:
        """400 naming the problem if the schema / regex / grammar cannot be compiled (checked in a
        worker thread and cached, so the event loop never waits on a large schema)."""
        try:
            await self.off_loop(param, check_spec, spec)
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param) from None
        except APIError:
            raise
        except Exception:  # noqa: BLE001 - e.g. a schema xgrammar cannot handle: the client's input, not a 500
            logger.exception("checking the %s constraint failed", spec.kind)
            raise bad_request(f"{param}: this {spec.kind} constraint cannot be compiled", param) from None

    def check_text_fits(self, chars: int, param: str) -> None:
        """A 400 naming `param` when `chars` characters of text are more than any prompt that fits the
        context can hold (each token stands for at most `max_token_chars` of them; 4x that for a normalizer
        that composes characters), before they are tokenized: megabytes of text take seconds of the prompt
        pool that every request's tokenizing waits for."""
        limit = self.context_limit
        most = limit * self.tokenizer.max_token_chars * 4
        if chars > most:
            raise bad_request(
                f"{param} holds {chars} characters, more than this model's {limit}-token context can take "
                f"(at most {most} characters in tokens of its vocabulary); shorten the {param}",
                param,
                "context_length_exceeded",
            )

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids (in the prompt pool), a 400 naming `param` as soon as its first part is more
        tokens than the context: ordinary text is at most ~8 characters a token, so a text of more than 16
        a token of context is tokenized in full only when its first 16 a token fit (whitespace runs, which
        one token may hold dozens of), not for seconds before it is refused for its length."""
        limit = self.context_limit
        probe = limit * 16
        # (a cut word splits into a few more tokens than it would whole: the margin)
        if len(text) > probe and len(self.tokenizer.encode(text[:probe], add_special_tokens=False)) > limit + 16:
            raise bad_request(
                f"{param}: its first {probe} characters alone are more than this model's {limit}-token context",
                param,
                "context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_size(self, prompt: str | list[int], param: str) -> None:
        """`check_text_fits` for a text prompt; a token-id prompt longer than the context is a 400 before its
        ids are checked or decoded."""
        if isinstance(prompt, str):
            return self.check_text_fits(len(prompt), param)
        if len(prompt) > self.context_limit:
            raise bad_request(
                f"{param} has {len(prompt)} token ids, more than this model's {self.context_limit}-token context",
                param,
                "context_length_exceeded",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"{param} contains token ids outside the vocabulary [0, {self.vocab_size})", param)

    def fit_to_context(
        self, num_prompt: int, params: SamplingParams, prompt_param: str, max_tokens_param: str = "max_tokens"
    ) -> SamplingParams:
        """Check the prompt (and max_tokens) fit; default max_tokens to the room left.
        Returns a copy of params with max_tokens set."""
        limit = self.context_limit
        why = "maximum context length" if limit == self.max_model_len else "KV cache capacity"
        if num_prompt == 0:
            raise bad_request(f"{prompt_param} must contain at least one token", prompt_param)
        if num_prompt >= limit:
            raise bad_request(
                f"This model's {why} is {limit} tokens, but the {prompt_param} has {num_prompt} "
                f"tokens (at least one more is needed for the completion). Shorten the "
                f"{prompt_param}.",
                prompt_param,
                "context_length_exceeded",
            )
        if params.max_tokens is None:
            room = limit - num_prompt
            if params.min_tokens > room:
                raise bad_request(
                    f"min_tokens ({params.min_tokens}) is more than the {room} tokens left in the "
                    f"context after the {prompt_param} ({num_prompt} tokens)",
                    "min_tokens",
                )
            return dataclasses.replace(params, max_tokens=room)
        if num_prompt + params.max_tokens > limit:
            raise bad_request(
                f"This model's {why} is {limit} tokens, but {num_prompt + params.max_tokens} "
                f"were requested ({num_prompt} in the {prompt_param}, {params.max_tokens} for the "
                f"completion). Lower {max_tokens_param} or shorten the {prompt_param}.",
                max_tokens_param,
                "context_length_exceeded",
            )
        return dataclasses.replace(params)

    def submit(self, *request) -> RequestStream:
        """`EngineClient.generate(*request)` (request id, prompt text, prompt ids, params, arrival, priority,
        cache_salt), its refusals as the HTTP errors they are."""
        try:
            return self.client.generate(*request)
        except (EngineDeadError, QueueFullError) as e:
            raise engine_error(e) from None

    def submit_all(
        self,
        prompts: list[tuple[str, str | None, list[int], SamplingParams]],
        arrival: float,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Submit several prompts; if one cannot be submitted, abort the ones already in."""
        queue, total = self.client.max_queue, sum(p.n for *_, p in prompts)
        if queue is not None and self.client.waiting_estimate() + total > queue:
            raise engine_error(QueueFullError(f"the server's waiting queue is full ({queue} requests); retry later"))
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

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], offset: int
    ) -> tuple[dict, int]:
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

    def echo_logprobs(self, prompt_ids: list[int], entries: list) -> tuple[dict, int]:
        """Legacy format for echoed prompt tokens (engine prompt logprobs); the first token has none
        (null), as OpenAI does. Returns it and the text offset after the prompt."""
        first = self.token_text(prompt_ids[0])
        out = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        rest, offset = self.completion_logprobs(prompt_ids[1:], entries[1:], len(first))
        return merge_logprobs(out, rest), offset

    def vllm_prompt_logprobs(self, entries: list) -> list:
        """vLLM's `prompt_logprobs` field: per prompt token, {token id: {logprob, rank, decoded_token}}."""
        return [
            None
            if e is None
            else {
                str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": self.token_text(t)}
                for t, lp in e.items()
            }
            for e in entries
        ]

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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `reasoning_tokens` (with a reasoning parser) fills completion_tokens_details."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def count_reasoning_tokens(token_ids: list[int], end_ids: tuple[int, ...], in_reasoning: bool) -> int:
    """Output tokens spent thinking: up to and including the end marker (all of them if it never came)."""
    if not in_reasoning:
        return 0
    n = len(end_ids)
    for i in range(len(token_ids) - n + 1):
        if tuple(token_ids[i : i + n]) == end_ids:
            return i + n
    return len(token_ids)
