"""The server's streamed responses: SSE events, several requests' outputs merged.

A response stops when the client goes away (`tokenmill.asgi`); cancellation closes the request's
`RequestStream`, which aborts it in the engine core (its KV blocks are freed at the core's next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenmill.asgi import ClientDisconnected, run_until_disconnect, stream_response

if TYPE_CHECKING:
    from tokenmill.server.request_stream import RequestStream, StreamOutput

__all__ = [
    "ClientDisconnected",
    "SSEResponse",
    "choice_chunk_builder",
    "gather_or_cancel",
    "merge_streams",
    "run_until_disconnect",
    "sse",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)


def sse(data: dict | str, event: str | None = None) -> str:
    """One SSE event; `event` names its type on an `event:` line (the Responses and Messages APIs)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n" if event is None else f"event: {event}\ndata: {payload}\n\n"


def object_head(request_id: str, kind: str, model: str, created: int) -> dict:
    """The fields an OpenAI completion object, or a chunk of its stream, starts with (`kind`: its "object")."""
    return {"id": request_id, "object": kind, "created": created, "model": model, "system_fingerprint": None}


def choice_chunk_builder(base: dict, include_usage: bool, content_key: str):
    """`chunk(index, content, logprobs, finish_reason, **extra) -> str`: one streamed choice as an SSE
    event, `content_key` being "text" (completions) or "delta" (chat), `extra` more choice fields;
    `usage: null` until the last chunk when the client asked for usage."""

    def chunk(index: int, content, logprobs, finish_reason, **extra) -> str:
        body = dict(
            base,
            choices=[
                {"index": index, content_key: content, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
            ],
        )
        if include_usage:
            body["usage"] = None
        return sse(body)

    return chunk


class SSEResponse(Response):
    """`text/event-stream` from an async iterator of already formatted events. Stops the iterator
    (so the request is aborted) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object] | None = None) -> None:
        super().__init__(
            status_code=200,
            media_type=self.media_type,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.on_close = on_close  # runs however the response ends (even if never started)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            error = await stream_response(
                send, receive, self.status_code, self.raw_headers, self._pump, self.events.aclose
            )
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
