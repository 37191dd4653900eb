"""The router's FastAPI app: an OpenAI- and Anthropic-compatible front for several `tokenmill serve` replicas.

`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/messages` (and its count_tokens) and
`/v1/embeddings` go to the replica the policy picks (streams passed through chunk by chunk; a
`previous_response_id` to the replica that stored it, `upstream.pinned_replica`), `/v1/models` to any
healthy one; `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` to every healthy replica (the first
failure's answer is the client's, the others' effect stays); the client's key (Bearer or x-api-key) is
passed on and checked by the replicas. `/health` is 200 while one replica is
healthy and 503 otherwise; `/metrics` has the router's own counters; `/` is the replicas' web page,
whose `/ui/stats?replica=I` is replica I's, with the list of replicas added. A replica's answers, 4xx
included, reach the client unchanged; the router's own errors (413, 400 for a body that is not JSON,
502, 503) are in the shape of the API asked (Anthropic's for /v1/messages). A request whose replica
fails before answering (no connection, the connection dropped, or a 503) is retried once on another
healthy replica; with no healthy replica left the router answers 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.asgi import ClientDisconnected, run_until_disconnect
from tokenmill.http_front import APIError, add_ui_page, install_error_handlers, parse_json_object, read_body
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import PrefixPolicy
from tokenmill.router.prompt import routing_text
from tokenmill.router.replicas import ReplicaSet, check_all, health_loop
from tokenmill.router.upstream import (
    ANTHROPIC_PATHS,
    BROADCAST_PATHS,
    CLIENT_CLOSED,
    add_generation_routes,
    add_post_routes,
    error_body,
    error_response,
    failure_reason,
    pinned_replica,
    relay,
    request_headers,
    unless_stalled,
)

logger = logging.getLogger("tokenmill.router")


@dataclass
class RouterSettings:
    health_interval: float = 1.0  # seconds between health checks of every replica
    health_timeout: float = 5.0  # a /health slower than this fails the check
    connect_timeout: float = 5.0  # connecting to a replica; generation itself has no deadline here
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413 without reaching a replica (as the server's)
    ui: bool = True  # the web page at / and a replica's dashboard numbers at /ui/stats


class _InFlight:
    """Counts one request in flight on a replica until `release()` (which may be called more than once)."""

    def __init__(self, replica) -> None:
        self.replica, self.held = replica, True
        replica.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.replica.in_flight -= 1


def _then(first, then):
    """`first()` then `then()`, as one callback."""

    def both() -> None:
        first()
        then()

    return both


def build_router_app(urls: list[str], policy, settings: RouterSettings | None = None) -> FastAPI:
    settings = settings or RouterSettings()
    replicas = ReplicaSet(urls, on_unhealthy=policy.forget)
    metrics = RouterMetrics(replicas, policy.name)
    holder: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=settings.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        holder["client"] = client
        await check_all(client, replicas, settings.health_timeout)
        checks = asyncio.create_task(health_loop(client, replicas, settings.health_interval, settings.health_timeout))
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await client.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.replicas, app.state.policy, app.state.metrics = replicas, policy, metrics

    install_error_handlers(app, logger)

    def unavailable(message: str, anthropic: bool = False) -> JSONResponse:
        metrics.unavailable.inc()
        return JSONResponse(
            error_body(503, message, "service_unavailable", "no_healthy_replica", anthropic),
            status_code=503,
            headers={"retry-after": "1"},
        )

    async def forward(
        request: Request,
        method: str,
        path: str,
        body: bytes,
        text: str | None,
        pinned: int | None = None,
    ) -> Response:
        """The request sent to the replica the policy picks (to `pinned` when it is healthy), retried once
        elsewhere if that replica fails before answering."""
        client = holder["client"]
        anthropic = path in ANTHROPIC_PATHS
        tried: list[int] = []
        failure = None
        for attempt in range(2):  # the first try and one retry elsewhere
            candidates = replicas.healthy(exclude=tried)
            if attempt == 0 and pinned in candidates:
                candidates = [pinned]
            if not candidates:
                break
            decision = policy.choose(candidates, replicas.loads, text)
            replica = replicas[decision.replica]
            metrics.routed.labels(replica.url, decision.kind).inc()
            if isinstance(policy, PrefixPolicy) and text:
                metrics.match.observe(decision.match)
            release = _InFlight(replica).release
            upstream_request = client.build_request(
                method, replica.url + path, content=body, headers=request_headers(request, replica.index)
            )
            stalled = replica.stalled()
            try:
                upstream = await run_until_disconnect(
                    request, unless_stalled(client.send(upstream_request, stream=True), stalled)
                )
            except ClientDisconnected:
                release()
                return Response(status_code=CLIENT_CLOSED)
            except httpx.TransportError as e:
                release()
                metrics.failures.labels(replica.url).inc()
                failure = f"replica {replica.index} failed: {failure_reason(e)}"
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    replicas.mark_unhealthy(replica.index, f"cannot connect: {e}")
                tried.append(replica.index)
                if attempt == 0 and replicas.healthy(exclude=tried):
                    metrics.retries.labels(replica.url).inc()
                continue
            except BaseException:
                release()
                raise
            if upstream.status_code == 503 and attempt == 0 and replicas.healthy(exclude=[*tried, replica.index]):
                await upstream.aclose()  # draining, or its engine core is down: someone else may serve it
                release()
                tried.append(replica.index)
                metrics.retries.labels(replica.url).inc()
                failure = f"replica {replica.index} answered 503"
                continue
            on_failure = metrics.failures.labels(replica.url).inc
            if upstream.status_code == 200 and text:  # once answered, its prompt is in the replica's tiers
                release = _then(release, lambda: policy.answered(text))
            return await relay(request, upstream, replica.index, release, stalled, on_failure, anthropic)
        why = failure or "no replica passed its last health check"
        return unavailable(f"no healthy replica to serve the request ({why})", anthropic)

    async def checked_body(request: Request) -> tuple[bytes, dict]:
        """The body and its JSON object: the server's 413 / 400 for a body no replica would take, here."""
        body = await read_body(request, settings.max_body_bytes)
        return body, parse_json_object(body)

    async def generation(request: Request, path: str) -> Response:
        try:
            body, parsed = await checked_body(request)
        except APIError as e:
            return error_response(e, path in ANTHROPIC_PATHS)
        pinned = pinned_replica(path, parsed, len(replicas))
        return await forward(request, "POST", path, body, routing_text(path, parsed), pinned)

    add_generation_routes(app, generation)

    async def broadcast(request: Request, path: str) -> Response:
        """The request sent to every healthy replica at once; the first failure's answer, else the first's."""
        body, _ = await checked_body(request)
        targets = [replicas[i] for i in replicas.healthy()]
        if not targets:
            return unavailable("no healthy replica to serve the request")
        answers = await asyncio.gather(
            *(holder["client"].post(r.url + path, content=body, headers=request_headers(request)) for r in targets),
            return_exceptions=True,
        )
        for replica, answer in zip(targets, answers):
            if isinstance(answer, BaseException):
                metrics.failures.labels(replica.url).inc()
                message = f"replica {replica.index} failed: {type(answer).__name__} (the others did it)"
                return JSONResponse(error_body(502, message, "server_error", "replica_failed"), status_code=502)
        answer = next((a for a in answers if a.status_code != 200), answers[0])
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    add_post_routes(app, BROADCAST_PATHS, broadcast)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(request, "GET", "/v1/models", b"", None)

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with either)
    async def health() -> Response:
        healthy = replicas.healthy()
        states = [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "error": r.last_error} for r in replicas
        ]
        if not healthy:
            body = error_body(503, "no healthy replica", "service_unavailable", "no_healthy_replica")
            return JSONResponse(body | {"replicas": states}, status_code=503, headers={"retry-after": "1"})
        return JSONResponse({"status": "ok", "healthy_replicas": len(healthy), "replicas": states})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if settings.ui:

        @app.get("/ui/stats")
        async def dashboard_stats(request: Request) -> Response:
            """Replica `?replica=I`'s /ui/stats (default 0; the replica checks the key the client sent),
            plus `replicas` for the page's picker."""
            raw = request.query_params.get("replica", "0")
            if not (raw.isascii() and raw.isdigit() and int(raw) < len(replicas)):
                raise APIError(400, f"replica must be an index below {len(replicas)}, got {raw!r}", param="replica")
            replica = replicas[int(raw)]
            params = {k: v for k, v in request.query_params.items() if k != "replica"}
            try:
                upstream = await holder["client"].get(
                    replica.url + "/ui/stats",
                    params=params,
                    headers=request_headers(request),
                    timeout=settings.health_timeout,
                )
            except httpx.TransportError as e:
                return unavailable(f"replica {replica.index} did not answer: {type(e).__name__}")
            if upstream.status_code != 200:
                return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))
            listed = [
                {"index": r.index, "url": r.url, "healthy": r.healthy, "in_flight": r.in_flight} for r in replicas
            ]
            return JSONResponse(upstream.json() | {"replica": replica.index, "replicas": listed})

        add_ui_page(app)

    return app
