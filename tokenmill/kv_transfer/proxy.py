"""`tokenmill disagg-proxy`: an OpenAI-compatible front for one prefill (producer) and one decode
(consumer) server.

Each generation request goes first to the prefill server with a new transfer id in
`kv_transfer_params`, `max_tokens: 1` and no streaming; once that answers, the original request (the
same transfer id added) goes to the decode server, whose answer — streamed or not — is passed to the
client as the router passes a replica's (`router/upstream.py`). An error from the prefill server
reaches the client unchanged. Requests one transfer cannot carry (several prompts, n > 1) go to the
decode server alone, which then prefills them itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.asgi import ClientDisconnected, run_until_disconnect
from tokenmill.http_front import APIError, install_error_handlers, parse_json_object, read_body
from tokenmill.router.upstream import (
    ANTHROPIC_PATHS,
    CLIENT_CLOSED,
    add_generation_routes,
    error_body,
    error_response,
    relay,
    request_headers,
    response_headers,
)

logger = logging.getLogger("tokenmill.disagg_proxy")

PREFILL, DECODE = 0, 1  # the index the proxy's answers carry in x-tokenmill-replica
MAX_BODY_BYTES = 8 * 2**20  # the server's default --max-body-bytes


def prefill_body(data: dict, transfer_id: str) -> dict:
    """The prefill leg of a request: one token, not streamed, tagged with the transfer."""
    body = {k: v for k, v in data.items() if k not in ("stream", "stream_options", "min_tokens")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body | {"stream": False, "kv_transfer_params": {"transfer_id": transfer_id}}


def transferable(data) -> bool:
    """Whether one KV transfer can carry the request's prefill (a single prompt, one sequence)."""
    if not isinstance(data, dict) or data.get("n") not in (None, 1):
        return False
    prompt = data.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


def build_proxy_app(prefill_url: str, decode_url: str, connect_timeout: float = 5.0) -> FastAPI:
    holder: dict[str, httpx.AsyncClient] = {}
    urls = {PREFILL: prefill_url.rstrip("/"), DECODE: decode_url.rstrip("/")}
    names = {PREFILL: "prefill", DECODE: "decode"}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        holder["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        try:
            yield
        finally:
            await holder["client"].aclose()

    app = FastAPI(title="tokenmill disagg-proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, logger)

    def unreachable(which: int, e: Exception) -> JSONResponse:
        message = f"the {names[which]} server ({urls[which]}) failed: {type(e).__name__}"
        return JSONResponse(error_body(502, message, "server_error", f"{names[which]}_failed"), status_code=502)

    async def send(request: Request, which: int, method: str, path: str, body: bytes) -> httpx.Response:
        client = holder["client"]
        upstream = client.build_request(method, urls[which] + path, content=body, headers=request_headers(request))
        return await run_until_disconnect(request, client.send(upstream, stream=True))

    async def forward(request: Request, which: int, method: str, path: str, body: bytes) -> Response:
        try:
            upstream = await send(request, which, method, path, body)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except httpx.HTTPError as e:
            return unreachable(which, e)
        return await relay(request, upstream, which, lambda: None)

    async def generation(request: Request, path: str) -> Response:
        try:  # the server's 413 / 400 for a body neither server would take, answered here, in the API's shape
            body = await read_body(request, MAX_BODY_BYTES)
            data = parse_json_object(body)
        except APIError as e:
            return error_response(e, path in ANTHROPIC_PATHS)
        if not transferable(data):
            return await forward(request, DECODE, "POST", path, body)
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        try:
            prefill = await send(request, PREFILL, "POST", path, json.dumps(prefill_body(data, transfer_id)).encode())
            try:
                answer = await run_until_disconnect(request, prefill.aread())
            finally:
                await prefill.aclose()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except httpx.HTTPError as e:
            return unreachable(PREFILL, e)
        if prefill.status_code != 200:  # the client's error (400), or the prefill server's
            response = Response(content=answer, status_code=prefill.status_code)
            response.raw_headers = response_headers(prefill, PREFILL, decoded=True) + [
                (b"content-length", str(len(answer)).encode())
            ]
            return response
        decode = dict(data, kv_transfer_params={"transfer_id": transfer_id})
        return await forward(request, DECODE, "POST", path, json.dumps(decode).encode())

    add_generation_routes(app, generation)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(request, DECODE, "GET", "/v1/models", b"")

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with either)
    async def health() -> Response:
        states = {}
        for which, url in urls.items():
            try:
                states[names[which]] = (await holder["client"].get(url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                states[names[which]] = False
        if not all(states.values()):
            body = error_body(503, "a prefill or decode server is not healthy", "service_unavailable", "unhealthy")
            return JSONResponse(body | {"servers": states}, status_code=503, headers={"retry-after": "1"})
        return JSONResponse({"status": "ok", "servers": states})

    return app
