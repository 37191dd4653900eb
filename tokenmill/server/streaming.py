"""HTTP plumbing for long requests: SSE responses and noticing a client that went away.

Both paths watch the ASGI `receive` channel for `http.disconnect` while generating, and cancel
the generation when it arrives; cancellation closes the request's `RequestStream`, which aborts
it in the engine core (its KV blocks are freed at the core's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:  # the router and the disaggregation proxy use this module without the engine
    from tokenmill.server.request_stream import RequestStream, StreamOutput

T = TypeVar("T")
logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must already have been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if not task.done():  # the client left first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected
    return task.result()


async def stream_response(send: Send, receive: Receive, status: int, headers: list[tuple[bytes, bytes]],
                          pump: Callable[[Send], Awaitable[None]], aclose: Callable[[], Awaitable[object]]
                          ) -> BaseException | None:
    """Start a streamed response and run `pump(send)` until it ends or the client disconnects; then
    cancel what still runs and close the source with `aclose` (errors there are no longer anyone's to
    answer). Returns the pump's exception, if it raised one."""
    tasks: list[asyncio.Future] = []
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        tasks = [asyncio.ensure_future(pump(send)), asyncio.ensure_future(wait_for_disconnect(receive))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return tasks[0].exception() if tasks[0].done() and not tasks[0].cancelled() else None
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await aclose()


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


def choice_chunk_builder(base: dict, include_usage: bool, content_key: str):
    """`chunk(index, content, logprobs, finish_reason, **extra) -> str`: one streamed choice as an SSE
    event, `content_key` being "text" (completions) or "delta" (chat), `extra` more choice fields;
    `usage: null` until the last chunk when the client asked for usage."""
    def chunk(index: int, content, logprobs, finish_reason, **extra) -> str:
        body = dict(base, choices=[{"index": index, content_key: content, "logprobs": logprobs,
                                    "finish_reason": finish_reason, **extra}])
        if include_usage:
            body["usage"] = None
        return sse(body)

    return chunk


class SSEResponse(Response):
    """`text/event-stream` from an async iterator of already formatted events. Stops the iterator
    (so the request is aborted) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object] | None = None) -> None:
        super().__init__(status_code=200, media_type=self.media_type,
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.on_close = on_close  # runs however the response ends (even if never started)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            error = await stream_response(send, receive, self.status_code, self.raw_headers, self._pump,
                                          self.events.aclose)
            if error is not None:
                logger.error("streaming response failed", exc_info=error)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _pump(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Interleave several requests' outputs as they come: yields (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
            merged.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """asyncio.gather that cancels the others when one fails (no orphaned generations)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
