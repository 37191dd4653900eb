"""The FastAPI app: routes, API-key check, body limits, and OpenAI-style errors for everything.

No route lets an exception reach the client as a stack trace: the body limit and the error handlers
are the ones every front shares (`tokenmill/http_front.py`): `APIError`s carry their status, HTTP
errors (404 route, 405 method) are reshaped, anything else is logged and answered with a JSON 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tokenmill
from tokenmill.http_front import add_ui_page, anthropic_error, install_error_handlers, read_body
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.limits import RequestLimits
from tokenmill.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tokenmill.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    parse_body,
)
from tokenmill.server.protocol_anthropic import MessagesRequest
from tokenmill.server.protocol_responses import ResponsesRequest
from tokenmill.server.request_stream import EngineDeadError
from tokenmill.server.serving import ServingContext, engine_error
from tokenmill.server.serving_chat import chat_prompt_ids, create_chat_completion
from tokenmill.server.serving_completions import create_completion
from tokenmill.server.serving_embeddings import create_embedding
from tokenmill.server.serving_lora import update_lora
from tokenmill.server.serving_messages import count_message_tokens, create_message
from tokenmill.server.serving_responses import ResponseStore, create_response
from tokenmill.server.ui.stats import UIStats, window_param

logger = logging.getLogger("tokenmill.server")


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    log_interval: float = 10.0  # seconds between throughput lines; 0 disables
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: split <think> output into reasoning_content
    max_stored_responses: int = 256  # /v1/responses kept for previous_response_id (least recently used dropped)
    limits: RequestLimits = field(default_factory=RequestLimits)
    ui: bool = True  # the web page at / and its numbers at /ui/stats
    price_per_hour: float | None = None  # the machine's price: the page's cost per million tokens


def build_app(
    client: EngineClient, metrics: ServerMetrics, model_names: list[str], settings: ServerSettings
) -> FastAPI:
    info = client.info
    ctx = ServingContext(
        client,
        client.tokenizer,
        list(model_names),
        info["max_model_len"],
        info["capacity_tokens"],
        info["vocab_size"],
        settings.reasoning_parser,
        settings.limits,
        info.get("lora_modules"),
    )
    created = int(time.time())
    stored_responses = ResponseStore(settings.max_stored_responses)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.attach(asyncio.get_running_loop())
        ticker = asyncio.create_task(_log_periodically(metrics, settings.log_interval))
        try:
            yield
        finally:
            ticker.cancel()
            client.begin_shutdown()
            await asyncio.to_thread(client.stop_process)

    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        description="An OpenAI-compatible server. Request bodies are parsed strictly (a string is not a "
        "number); every invalid field is a 400 naming it.",
    )
    app.state.ctx = ctx
    app.openapi = lambda: _openapi(app)

    install_error_handlers(app, logger)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(bad_request(f"invalid request: {e.errors()[0].get('msg')}").to_dict(), status_code=400)

    # ---- helpers ---------------------------------------------------------------------------------

    def check_api_key(request: Request) -> None:
        """'Authorization: Bearer KEY' (OpenAI's clients) or 'x-api-key: KEY' (Anthropic's)."""
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                "authentication_error",
                None,
                "invalid_api_key",
            )

    # ---- routes ----------------------------------------------------------------------------------

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with either)
    async def health() -> Response:
        if client.shutting_down or client.draining:
            raise APIError(
                503, "the server is shutting down", "service_unavailable", None, "shutting_down", {"retry-after": "5"}
            )
        if not client.healthy:
            why = client.dead_reason or "the engine core process is not running"
            if client.restarting:
                why += "; it is being restarted"
            raise APIError(503, why, "service_unavailable", None, "engine_unavailable", {"retry-after": "5"})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": tokenmill.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if settings.ui:
        ui_stats = UIStats(metrics.registry, model_names[0], settings.price_per_hour)

        @app.get("/ui/stats", include_in_schema=False)
        async def dashboard_stats(request: Request) -> Response:
            """The web page's dashboard: windowed latency percentiles, rates and gauges as one JSON object."""
            check_api_key(request)
            return JSONResponse(ui_stats.stats(window_param(request.query_params.get("window"))))

        add_ui_page(app)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "tokenmill",
                "root": name,
                "parent": None,
                "max_model_len": ctx.context_limit,
            }
            for name in ctx.model_names
        ]
        data += [  # LoRA adapters: a request names one as its model
            dict(data[0], id=name, root=path, parent=ctx.model_names[0]) for name, path in (ctx.loras or {}).items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def generate(request: Request, body_type, create) -> Response:
        """The OpenAI endpoints that take a body: stamp arrival, check the key, parse the body, serve."""
        arrival = time.monotonic()
        check_api_key(request)
        body = await read_body(request, settings.max_body_bytes)
        return await create(ctx, parse_body(body_type, body), request, arrival)

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest), summary="Completions (OpenAI)")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest), summary="Chat completions (OpenAI)")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/embeddings", openapi_extra=_body(EmbeddingRequest), summary="Embeddings (OpenAI)")
    async def embeddings(request: Request) -> Response:
        return await generate(request, EmbeddingRequest, create_embedding)

    @app.post("/v1/load_lora_adapter", openapi_extra=_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        return await generate(request, LoadLoRAAdapterRequest, update_lora)

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        return await generate(request, UnloadLoRAAdapterRequest, update_lora)

    @app.post("/v1/responses", openapi_extra=_body(ResponsesRequest), summary="Responses (OpenAI)")
    async def responses(request: Request) -> Response:
        return await generate(request, ResponsesRequest, lambda *args: create_response(*args, store=stored_responses))

    async def in_anthropic_shape(request: Request, answer) -> Response:
        """The Messages API's errors in Anthropic's shape ({"type": "error", "error": {...}})."""
        try:
            return await answer
        except APIError as e:
            return JSONResponse(anthropic_error(e), status_code=e.status, headers=e.headers)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            error = APIError(500, "internal server error (see the server log)", "internal_server_error")
            return JSONResponse(anthropic_error(error), status_code=500)

    @app.post("/v1/messages", openapi_extra=_body(MessagesRequest), summary="Messages (Anthropic)")
    async def messages(request: Request) -> Response:
        return await in_anthropic_shape(request, generate(request, MessagesRequest, create_message))

    @app.post("/v1/messages/count_tokens", openapi_extra=_body(MessagesRequest), summary="Count tokens (Anthropic)")
    async def count_tokens(request: Request) -> Response:
        return await in_anthropic_shape(
            request, generate(request, MessagesRequest, lambda ctx, req, *_: count_message_tokens(ctx, req))
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """Admin: forget every cached prefix block (behind the API key when one is set)."""
        check_api_key(request)
        try:
            dropped = await client.reset_prefix_cache()
        except EngineDeadError as e:
            raise engine_error(e) from None
        return JSONResponse({"status": "ok", "blocks_dropped": dropped})

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        check_api_key(request)
        req = parse_body(TokenizeRequest, await read_body(request, settings.max_body_bytes))
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
            ]
            ids = await chat_prompt_ids(ctx, messages, req.add_generation_prompt)
        else:
            ctx.check_prompt_size(req.prompt, "prompt")
            ids = await ctx.off_loop("prompt", ctx.encode, req.prompt, "prompt", req.add_special_tokens)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": ctx.context_limit,
                "tokens": ids,
                "token_strs": [ctx.token_text(t) for t in ids],
            }
        )

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        check_api_key(request)
        req = parse_body(DetokenizeRequest, await read_body(request, settings.max_body_bytes))
        ctx.check_model(req.model)
        ctx.check_prompt_size(req.tokens, "tokens")
        ctx.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": await ctx.off_loop("tokens", ctx.tokenizer.decode, req.tokens)})

    return app


_BODIES = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    ResponsesRequest,
    MessagesRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def _body(model) -> dict:
    """The OpenAPI requestBody of a route whose handler parses `model` itself (strict JSON)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, plus the request models with every accepted field."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODIES:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


async def _log_periodically(metrics: ServerMetrics, interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        metrics.log_throughput()
