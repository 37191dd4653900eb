"""What every HTTP front (`serve`, `router`, `disagg-proxy`) does the same way with a request: read the
body under a size limit, parse JSON under a depth limit, and answer every failure as an OpenAI-style
JSON error (`{"error": {"message", "type", "param", "code"}}`), never a plain-text 500; and serve the
web page (`add_ui_page`).

Kept free of torch, pydantic and the engine: the router and the proxy import it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

# How deeply a body's arrays and objects may nest: pydantic's JSON parser (the server's) stops at this
# depth, so every front refuses the same bodies.
MAX_JSON_DEPTH = 200


class APIError(Exception):
    """An error to send as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# HTTP status -> Anthropic's error type
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(e: APIError) -> dict:
    """`e` in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`; the message names the
    field. Here, not with the Messages API's schemas, because the router answers in it too."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(e.status, "api_error"), "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_json(message: str) -> APIError:
    return bad_request(message, None, "invalid_json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 as soon as it is known to exceed `limit` bytes (declared or received); 415 for
    a body that says it is not JSON (a form, text/plain: what another site's page may send this server
    without asking the browser first, as the JSON content type may not be)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415,
            f"content-type {media_type[:60]!r} is not JSON: send the body as application/json",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body of {declared} bytes exceeds the limit of {limit} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(
                413,
                f"request body exceeds the limit of {limit} bytes",
                "invalid_request_error",
                None,
                "request_too_large",
            )
    return bytes(body)


def parse_json_object(raw: bytes) -> dict:
    """A body that must be a JSON object, or a 400: empty, not UTF-8 JSON, nested deeper than
    MAX_JSON_DEPTH, or not an object at the top."""
    if not raw.strip():
        raise invalid_json("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise invalid_json(f"the request body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise invalid_json(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise invalid_json("the request body must be a JSON object")
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise invalid_json(f"the request body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _deeper_than(value, limit: int) -> bool:
    """Whether arrays / objects nest more than `limit` levels (iteratively: no recursion to overflow)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        kinds = set(map(type, children))  # (a C loop: a prompt of a million token ids is a list of ints)
        if dict in kinds or list in kinds:
            stack.extend((c, depth + 1) for c in children if type(c) in (dict, list))
    return False


class _InternalErrors:
    """ASGI middleware: an error no handler took, logged and answered with a JSON 500 (no stack trace
    reaches the client). Starlette's own catch-all (`exception_handler(Exception)`) answers, then raises
    the error on to the server, which drops the connection: the client's next request on it was lost.
    Here the error ends with the answer; one raised after the answer started (a stream) is raised on,
    as nothing can be said then. A client that went while its request's body was read gets no answer
    and no stack trace in the log (a line at info)."""

    def __init__(self, app, logger: logging.Logger) -> None:
        self.app, self.logger = app, logger

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:  # the client went while its body was read (or was cut off: too slow)
            self.logger.info(
                "%s %s: the client went before its request body was in", scope.get("method"), scope.get("path")
            )
        except Exception as e:
            self.logger.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=e)
            if started:
                raise
            body = APIError(500, "internal server error (see the server log)", "internal_server_error").to_dict()
            await JSONResponse(body, status_code=500)(scope, receive, send)


class _SameSiteOnly:
    """ASGI middleware: a request that changes something (not GET / HEAD / OPTIONS) which the browser marks
    as sent by another site's page (`Sec-Fetch-Site: cross-site`) gets a 403. Such a page may make a browser
    send a POST the page itself cannot read the answer of (a form, a body without a content type); on a
    server without --api-key it would still start work there. Clients other than browsers send no such
    header, and this server's own page is same-origin; no route answers cross-origin requests (no CORS)
    either, so nothing that worked is lost."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            site = next((v for k, v in scope.get("headers", ()) if k == b"sec-fetch-site"), b"")
            if site.strip().lower() == b"cross-site":
                message = (
                    "a request from another site's page is refused: call this server from its own page or a client"
                )
                error = APIError(403, message, "permission_error", None, "cross_site_request")
                anthropic = scope.get("path", "").startswith("/v1/messages")
                body = anthropic_error(error) if anthropic else error.to_dict()
                return await JSONResponse(body, status_code=403)(scope, receive, send)
        await self.app(scope, receive, send)


def install_error_handlers(app, logger: logging.Logger) -> None:
    """APIError with its status; Starlette's HTTP errors (404 route, 405 method) reshaped; anything
    else logged and answered with a JSON 500, the connection kept (`_InternalErrors`); and a cross-site
    page's requests refused (`_SameSiteOnly`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(
            APIError(e.status_code, message, kind).to_dict(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    app.add_middleware(_InternalErrors, logger=logger)
    app.add_middleware(_SameSiteOnly)


# The web page's files: they live with the server (tokenmill/server/ui/) and the router serves the same
# ones, found by path so that the router imports nothing of the server.
UI_DIR = Path(__file__).parent / "server" / "ui"
_UI_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# The page runs only its own files and talks only to this origin; no other site may frame it.
_UI_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def add_ui_page(app) -> None:
    """`/` (the web page: chat playground and dashboard) and its scripts and style at /ui/. Public even
    with an API key: they hold no data. The page asks for the key when a data route answers 401 and
    sends it as a Bearer header, as any client does; it is never a cookie, so another site's page
    cannot make the browser send it."""

    def serve(body: bytes, media_type: str):
        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=_UI_HEADERS)

        return endpoint

    for path in sorted(UI_DIR.iterdir()):
        if media_type := _UI_MEDIA_TYPES.get(path.suffix):
            route = "/" if path.name == "index.html" else f"/ui/{path.name}"
            app.add_route(route, serve(path.read_bytes(), media_type), methods=["GET"], include_in_schema=False)
