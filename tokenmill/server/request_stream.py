"""A request's outputs as the HTTP handlers consume them: `RequestStream` (one per request, fed by
the engine client step by step) and the errors a stream can raise instead of an output."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.engine.core import RequestRejected
from tokenmill.engine.output_processor import CompletionOutput, RequestOutput
from tokenmill.engine.outputs import Logprob

if TYPE_CHECKING:
    from tokenmill.server.engine_client import EngineClient


class EngineDeadError(RuntimeError):
    """The core process is gone (crashed, killed, or the server is shutting down)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows."""


class RequestFailed(RuntimeError):
    """The engine failed on this request (its other requests were not affected)."""


class RequestTimeout(RuntimeError):
    """The request ran past its deadline (--request-timeout) and was aborted."""


def failure_of(result: RequestOutput) -> Exception | None:
    """The error of a request one of whose samples the engine failed on, or None."""
    for o in result.outputs:
        if o.error is not None:
            return RequestRejected(o.error, o.error_param) if o.error_param else RequestFailed(o.error)
    return None


@dataclass
class SampleDelta:
    """What one step added to one of a request's `n` samples (copied: safe to keep)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class StreamOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    deltas: list[SampleDelta]  # only the samples that changed this step
    finished: bool
    outputs: list[CompletionOutput]  # cumulative per sample; final once `finished`
    prompt_logprobs: list | None = None  # once known (the request asked): one entry per prompt token, first None
    pooled: list[float] | None = None  # an embedding request's pooled hidden state, in its last output


def copy_step(result: RequestOutput, reported: set[int]) -> StreamOutput:
    """Snapshot a RequestOutput's per-step deltas (the processor reuses its objects next step)."""
    deltas = []
    for o in result.outputs:
        newly_finished = o.finish_reason is not None and o.index not in reported
        if o.delta_token_ids or o.delta_text or newly_finished:
            deltas.append(
                SampleDelta(
                    o.index,
                    o.delta_text,
                    list(o.delta_token_ids),
                    list(o.delta_logprobs) if o.delta_logprobs is not None else None,
                    o.finish_reason,
                    o.stop_reason,
                )
            )
            if newly_finished:
                reported.add(o.index)
    return StreamOutput(
        result.request_id,
        result.prompt_token_ids,
        result.num_cached_tokens,
        deltas,
        result.finished,
        result.outputs,
        result.prompt_logprobs,
        result.pooled,
    )


def _merge_steps(older: StreamOutput, newer: StreamOutput) -> StreamOutput:
    """Two undelivered steps as one: per sample, the texts, tokens and logprobs joined."""
    by_index = {d.index: d for d in older.deltas}
    for d in newer.deltas:
        old = by_index.get(d.index)
        if old is None:
            by_index[d.index] = d
            continue
        logprobs = None if old.logprobs is None and d.logprobs is None else (old.logprobs or []) + (d.logprobs or [])
        by_index[d.index] = SampleDelta(
            d.index, old.text + d.text, old.token_ids + d.token_ids, logprobs, d.finish_reason, d.stop_reason
        )
    return dataclasses.replace(
        newer,
        deltas=sorted(by_index.values(), key=lambda d: d.index),
        prompt_logprobs=newer.prompt_logprobs or older.prompt_logprobs,
        pooled=newer.pooled or older.pooled,
    )


class RequestStream:
    """One request's outputs, step by step. Use as `async with stream: async for out in stream:`;
    leaving the block before the request finished aborts it (client gone, error, cancellation).

    Steps the reader has not taken yet are merged into one, so a slow reader holds at most one
    pending output (no longer than the request's own output), never one item per engine step."""

    def __init__(self, client: EngineClient, request_id: str, deadline: float | None = None) -> None:
        self.client = client
        self.request_id = request_id
        self.deadline = deadline  # time.monotonic() past which the request is aborted
        self._pending: collections.deque[StreamOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.reported: set[int] = set()  # samples whose finish was already delivered

    def put(self, item: StreamOutput | BaseException) -> None:
        if self._pending and isinstance(item, StreamOutput) and isinstance(self._pending[-1], StreamOutput):
            self._pending[-1] = _merge_steps(self._pending[-1], item)
        else:
            self._pending.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def _wait(self) -> None:
        while not self._pending:
            self._ready.clear()
            if self.deadline is None:
                await self._ready.wait()
                continue
            try:
                await asyncio.wait_for(self._ready.wait(), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                self.close()
                raise RequestTimeout("the request took longer than the server's request timeout") from None

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._wait()
        item = self._pending.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def last(self) -> StreamOutput:
        """The request's final output (for an answer that is not streamed)."""
        last = None
        async for out in self:
            last = out
        return last

    async def started(self) -> None:
        """Wait for the request's first output; raise at once if it failed before producing one (so a
        constrained request whose grammar is refused gets a 400, not an error inside a 200 stream)."""
        await self._wait()
        if isinstance(self._pending[0], BaseException):
            self.finished = True
            raise self._pending.popleft()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
        self.client._streams.pop(self.request_id, None)


__all__ = [
    "EngineDeadError",
    "QueueFullError",
    "RequestFailed",
    "RequestRejected",
    "RequestStream",
    "RequestTimeout",
    "SampleDelta",
    "StreamOutput",
]
