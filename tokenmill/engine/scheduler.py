"""Scheduler: decides which tokens of which requests run in the next step.

One rule, as in vLLM v1: every request has `num_computed_tokens` and its tokens so far; each step
hands out a token budget, first to running requests (a decoding one needs one token, a request in
the middle of its prompt gets the next chunk), then to waiting requests in policy order. There is
no prefill or decode phase: prompt chunks and decode tokens share the step. A waiting request's
prompt tokens found in the prefix cache are not computed again, so they cost no budget.
"""

from __future__ import annotations

import heapq
import itertools
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


class FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, request: Request) -> bool:
        return request in self._q

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """Which running request gives way under KV pressure: the most recently admitted."""
        return running[-1]


class PriorityQueue(FCFSQueue):
    """Waiting requests by (priority, arrival): lower priority values run first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.times.arrival, next(self._tiebreak), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, request: Request) -> bool:
        return any(e[3] is request for e in self._heap)

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """The lowest-priority running request (latest arrival among equals) gives way."""
        return max(running, key=lambda r: (r.priority, r.times.arrival))


POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting = POLICIES[config.policy]()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.waiting.victim(self.running)
                position = self.running.index(victim)
                del self.running[position]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                if position < i:  # it was scheduled earlier in this step: the loop index shifts
                    i -= 1
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
        if out.preempted:  # requests already scheduled this step may have been preempted after
            out.scheduled = [s for s in out.scheduled if s.request.status == RequestStatus.RUNNING]

        # admit waiting requests only when nobody had to give way this step
        while len(self.waiting) and budget > 0 and not out.preempted \
                and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_computed
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                request.num_computed_tokens = 0
                break
            self.waiting.pop()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
                self.kv.record_lookup(request, num_computed)
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
        self.waiting.add_preempted(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and return its blocks (finished or aborted)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.free(request)
