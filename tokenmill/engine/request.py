"""A request as the engine core sees it: token ids, sampling parameters, progress and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.sampling_params import SamplingParams


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


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], arrival_time: float | None = None, priority: int = 0,
                 device: torch.device | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.priority = priority
        self.cache_salt = cache_salt  # prefix-cache namespace: only requests with the same salt share blocks
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.num_preemptions = 0
        self.times = RequestTimes(arrival_time if arrival_time is not None else time.monotonic())
        self.structured = None  # StructuredState of a constrained request (set by the engine core)
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device or "cpu").manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the two lists."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

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
