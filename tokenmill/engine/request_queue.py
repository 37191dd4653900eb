"""Waiting-request queues, one per scheduling policy: the order of admission, and which running
request gives way under KV-cache pressure."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from tokenmill.engine.request import Request


class FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def put_back(self, requests: list[Request]) -> None:
        """Return requests taken from the front (in the order taken) to the front, in that order."""
        self._q.extendleft(reversed(requests))

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

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

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
