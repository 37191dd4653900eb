"""ASGI plumbing every HTTP front shares (the server, the router, the disaggregation proxy): noticing
a client that went away while a long request runs, and streaming a response until it does.

Both watch the ASGI `receive` channel for `http.disconnect` and cancel the work when it arrives. This
module knows nothing of the engine (nor torch): the router and the proxy import it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive, Send

T = TypeVar("T")


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


async def stream_response(
    send: Send,
    receive: Receive,
    status: int,
    headers: list[tuple[bytes, bytes]],
    pump: Callable[[Send], Awaitable[None]],
    aclose: Callable[[], Awaitable[object]],
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
