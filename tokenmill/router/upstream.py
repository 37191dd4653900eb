"""HTTP plumbing between the client and a replica: header filtering, the client's disconnect, and
a streamed response passed through chunk by chunk."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.asgi import ClientDisconnected, run_until_disconnect, stream_response
from tokenmill.http_front import APIError

CLIENT_CLOSED = 499  # nginx's status for a client that went away; it never reaches anyone

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

REPLICA_HEADER = "x-tokenmill-replica"


def request_headers(request: Request) -> list[tuple[str, str]]:
    """The client's headers to send on to the replica (Authorization included)."""
    return [(k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_SKIP]


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


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def add_generation_routes(app, generation: Callable[[Request, str], Awaitable[Response]]) -> None:
    """POST /v1/completions and /v1/chat/completions, each answered by `generation(request, path)`."""

    def route_for(path: str):
        async def route(request: Request) -> Response:
            return await generation(request, path)

        return route

    for path in GENERATION_PATHS:
        app.add_api_route(path, route_for(path), methods=["POST"], include_in_schema=False)


def error_body(status: int, message: str, kind: str, code: str) -> dict:
    """An OpenAI-style error, as the replicas send them."""
    return APIError(status, message, kind, None, code).to_dict()


class StreamedResponse(Response):
    """A replica's streamed (SSE) response, passed to the client chunk by chunk as the bytes arrive.
    Closes the replica connection as soon as the client disconnects; if the replica fails mid-stream
    the client gets an error event and the end of the stream. `on_close` runs however it ends."""

    def __init__(self, upstream: httpx.Response, replica: int, on_close: Callable[[], None]) -> None:
        super().__init__(status_code=upstream.status_code)
        self.raw_headers = response_headers(upstream, replica, decoded=False)
        self.upstream, self.replica, self.on_close = upstream, replica, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await stream_response(send, receive, self.status_code, self.raw_headers, self._pump, self.upstream.aclose)
        finally:
            self.on_close()

    async def _pump(self, send: Send) -> None:
        try:
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            message = f"replica {self.replica} failed during the response: {type(e).__name__}"
            event = error_body(502, message, "server_error", "replica_failed")
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def relay(
    request: Request,
    upstream: httpx.Response,
    replica: int,
    release: Callable[[], None],
    on_failure: Callable[[], None] = lambda: None,
) -> Response:
    """The replica's answer for the client: an SSE stream passed on chunk by chunk, anything else read
    whole (502 if the replica fails meanwhile: `on_failure` runs). `release` runs once it is done."""
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamedResponse(upstream, replica, release)
    try:
        content = await run_until_disconnect(request, upstream.aread())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    except httpx.HTTPError as e:
        on_failure()
        body = error_body(
            502, f"replica {replica} failed during the response: {type(e).__name__}", "server_error", "replica_failed"
        )
        return JSONResponse(body, status_code=502)
    finally:
        await upstream.aclose()
        release()
    response = Response(content=content, status_code=upstream.status_code)
    response.raw_headers = response_headers(upstream, replica, decoded=True) + [
        (b"content-length", str(len(content)).encode())
    ]
    return response
