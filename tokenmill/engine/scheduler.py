"""Scheduler: decides which tokens of which requests run in the next step.

One rule, as in vLLM v1: every request has `num_computed_tokens` and its tokens so far; each step
hands out a token budget, first to running requests (a decoding one needs one token, a request in
the middle of its prompt gets the next chunk), then to waiting requests in order. There is no
prefill or decode phase: prompt chunks and decode tokens share the step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the request has all its tokens in the cache and samples a new one."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # the most recently admitted request gives way
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1

        # admit waiting requests only when nobody had to give way this step
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            _, num_computed = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_computed
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and return its blocks (finished or aborted)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.free(request)
