"""HTTP plumbing between the client and a replica: header filtering, the client's disconnect, a
streamed response passed through chunk by chunk, and the router's own errors in the shape of the API
asked (Anthropic's for /v1/messages, OpenAI's for the rest)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.asgi import ClientDisconnected, run_until_disconnect, stream_response
from tokenmill.http_front import APIError, anthropic_error

CLIENT_CLOSED = 499  # nginx's status for a client that went away; it never reaches anyone

T = TypeVar("T")


class ReplicaStalled(httpx.TransportError):
    """The replica stopped answering (a health check of it timed out) while a request waited on it."""


async def unless_stalled(work: Awaitable[T], stalled: asyncio.Future | None) -> T:
    """Await `work`; if `stalled` (None: never) is done first, cancel it and raise ReplicaStalled."""
    if stalled is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, stalled}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ReplicaStalled("it stopped answering (its health check timed out)")
    return task.result()


# hop-by-hop headers (RFC 9110 7.6.1), not passed on either way
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
# and those the two HTTP stacks set themselves
_REQUEST_SKIP = _HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
_RESPONSE_SKIP = _HOP_BY_HOP | {"content-length", "date", "server"}

# which replica answered (on responses to the client), and which replica a request is sent to (on
# requests to a replica: it tags its /v1/responses ids with it, see `pinned_replica`)
REPLICA_HEADER = "x-tokenmill-replica"


def request_headers(request: Request, replica: int | None = None) -> list[tuple[bytes, bytes]]:
    """The client's headers to send on to the replica (Authorization and x-api-key included), and which
    replica it is when given (a client's own header of that name is dropped). As the bytes they came in:
    a value with a byte past ASCII (which HTTP allows) is passed on as it is, not re-encoded."""
    skip = _REQUEST_SKIP | {REPLICA_HEADER}
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in skip]
    return headers + ([(REPLICA_HEADER.encode(), str(replica).encode())] if replica is not None else [])


def response_headers(upstream: httpx.Response, replica: int, decoded: bool) -> list[tuple[bytes, bytes]]:
    """The replica's response headers for the client, plus which replica answered. `decoded`: the body
    is sent decoded (httpx undid any content-encoding), so that header is dropped too."""
    skip = _RESPONSE_SKIP | ({"content-encoding"} if decoded else set())
    headers = [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in upstream.headers.multi_items()
        if k.lower() not in skip
    ]
    return headers + [(REPLICA_HEADER.encode(), str(replica).encode())]


GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
)
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # errors in Anthropic's shape
# each replica loads or unloads the adapter: every replica must serve every adapter's name
BROADCAST_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def add_post_routes(app, paths, answer: Callable[[Request, str], Awaitable[Response]]) -> None:
    """POST to each of `paths`, answered by `answer(request, path)`."""

    def route_for(path: str):
        async def route(request: Request) -> Response:
            return await answer(request, path)

        return route

    for path in paths:
        app.add_api_route(path, route_for(path), methods=["POST"], include_in_schema=False)


def add_generation_routes(app, generation: Callable[[Request, str], Awaitable[Response]]) -> None:
    """POST to each of GENERATION_PATHS, answered by `generation(request, path)`."""
    add_post_routes(app, GENERATION_PATHS, generation)


def error_body(status: int, message: str, kind: str, code: str, anthropic: bool = False) -> dict:
    """An error as the replicas send them: OpenAI's shape, or Anthropic's for its API."""
    error = APIError(status, message, kind, None, code)
    return anthropic_error(error) if anthropic else error.to_dict()


def error_response(e: APIError, anthropic: bool) -> JSONResponse:
    """The router's own error `e` for the client, in the shape of the API it asked."""
    return JSONResponse(anthropic_error(e) if anthropic else e.to_dict(), status_code=e.status, headers=e.headers)


_PINNED_ID = re.compile(r"resp_r(\d{1,4})_")


def pinned_replica(path: str, body: dict, replicas: int) -> int | None:
    """The replica a /v1/responses request must go to: the one that stored its `previous_response_id`.

    A replica behind the router tags the ids of the responses it creates with its index (`resp_r<I>_...`,
    from REPLICA_HEADER), so the router needs no table of ids: nothing to bound, nothing lost when it
    restarts, and an id from any replica of the list routes home."""
    previous = body.get("previous_response_id") if path == "/v1/responses" else None
    match = _PINNED_ID.match(previous) if isinstance(previous, str) else None
    return int(match[1]) if match and int(match[1]) < replicas else None


class StreamedResponse(Response):
    """A replica's streamed (SSE) response, passed to the client chunk by chunk as the bytes arrive.
    Closes the replica connection as soon as the client disconnects; if the replica fails mid-stream
    (or stops answering: `stalled` is done) the client gets an error event and the end of the stream. `on_close` runs however it ends."""

    def __init__(
        self,
        upstream: httpx.Response,
        replica: int,
        on_close: Callable[[], None],
        stalled: asyncio.Future | None,
        anthropic: bool = False,
    ) -> None:
        super().__init__(status_code=upstream.status_code)
        self.raw_headers = response_headers(upstream, replica, decoded=False)
        self.upstream, self.replica, self.on_close, self.anthropic = upstream, replica, on_close, anthropic
        self.stalled = stalled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await stream_response(send, receive, self.status_code, self.raw_headers, self._pump, self.upstream.aclose)
        finally:
            self.on_close()

    async def _pass_on(self, send: Send) -> None:
        async for chunk in self.upstream.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _pump(self, send: Send) -> None:
        try:
            await unless_stalled(self._pass_on(send), self.stalled)
        except httpx.HTTPError as e:
            message = f"replica {self.replica} failed during the response: {failure_reason(e)}"
            event = f"data: {json.dumps(error_body(502, message, 'server_error', 'replica_failed', self.anthropic))}"
            event = ("event: error\n" if self.anthropic else "") + event + "\n\n"  # Anthropic's events are named
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def failure_reason(e: httpx.HTTPError) -> str:
    """What a replica's failure is called in an error message."""
    return f"{e}" if isinstance(e, ReplicaStalled) else type(e).__name__


async def relay(
    request: Request,
    upstream: httpx.Response,
    replica: int,
    release: Callable[[], None],
    stalled: asyncio.Future | None = None,
    on_failure: Callable[[], None] = lambda: None,
    anthropic: bool = False,
) -> Response:
    """The replica's answer for the client: an SSE stream passed on chunk by chunk, anything else read
    whole (502 if the replica fails meanwhile, or stalls: `stalled` is done; `on_failure` runs;
    Anthropic's error shape when `anthropic`). `release` runs once it is done."""
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamedResponse(upstream, replica, release, stalled, anthropic)
    try:
        content = await run_until_disconnect(request, unless_stalled(upstream.aread(), stalled))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    except httpx.HTTPError as e:
        on_failure()
        message = f"replica {replica} failed during the response: {failure_reason(e)}"
        return JSONResponse(error_body(502, message, "server_error", "replica_failed", anthropic), status_code=502)
    finally:
        await upstream.aclose()
        release()
    response = Response(content=content, status_code=upstream.status_code)
    response.raw_headers = response_headers(upstream, replica, decoded=True) + [
        (b"content-length", str(len(content)).encode())
    ]
    return response
