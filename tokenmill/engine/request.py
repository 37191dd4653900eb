"""Requests: `EngineCoreRequest`, what crosses into the engine core (from the Python API or the
server's front-end process), and `Request`, the core's state of one: token ids, progress, timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One sample's request (the `n` fan-out happened before: see `OutputProcessor.add_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share blocks


SPEC_PRIOR = 0.9  # the acceptance rate a request starts with, and drifts back to while it drafts nothing


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class RequestTimes:
    """Monotonic timestamps (time.monotonic(), one clock for the whole server)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)  # one per generated token
    finished: float | None = None


class TokenSequence:
    """A prompt and the tokens generated after it (the core's `Request` and the model runner's
    per-request state both are one)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the two lists."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    params: SamplingParams

    def samples_after(self, num_new_tokens: int) -> bool:
        """Whether running `num_new_tokens` more tokens reaches the end of its tokens, so a next one is
        sampled (never for a request that only scores its prompt: max_tokens 0)."""
        return self.params.max_tokens != 0 and self.num_computed_tokens + num_new_tokens >= self.num_tokens


class Request(TokenSequence):
    """`params` is the request's own copy: the core fills in its defaults without touching the caller's."""

    def __init__(self, core_request: EngineCoreRequest, params: SamplingParams, eos_token_ids: set[int]) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.priority = core_request.priority
        self.cache_salt = core_request.cache_salt
        self.lora_id = 0  # its LoRA adapter's load id (set by the core; 0: the base model), in its prefix keys
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.num_preemptions = 0
        self.times = RequestTimes(core_request.arrival_time)
        self.structured = None  # StructuredState of a constrained request (set by the engine core)
        self.spec_token_ids: list[int] = []  # drafted tokens to verify in its next step (speculative decoding)
        self.spec_acceptance = SPEC_PRIOR  # its recent rate of accepted drafts (an estimate per draft position)
        # logprob entries of the prompt tokens, filled chunk by chunk (the first token has none); sent once
        self.prompt_logprobs = [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def append_token(self, token_id: int, now: float) -> RequestStatus | None:
        """Record a sampled token; return the finished status if the request is now done."""
        self.output_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.tokens.append(now)
        n = len(self.output_token_ids)
        if n >= self.params.min_tokens and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
