"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names): load a PEFT adapter into
the engine under a name requests then give as their `model`, or unload one. The engine core decides
(`EngineCore.load_lora` / `unload_lora`); the served names follow its answer."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, bad_request
from tokenmill.server.request_stream import EngineDeadError
from tokenmill.server.serving import ServingContext, engine_error


async def update_lora(
    ctx: ServingContext, req: LoadLoRAAdapterRequest | UnloadLoRAAdapterRequest, request: Request, arrival: float
) -> Response:
    """Load (a body with lora_path) or unload the adapter `req.lora_name`."""
    path = getattr(req, "lora_path", None)
    if ctx.loras is None:
        raise bad_request("LoRA adapters are off: start the server with --enable-lora", "lora_name")
    if path is None and req.lora_name not in ctx.loras:
        raise APIError(
            404, f"no LoRA adapter named {req.lora_name!r} is loaded", "invalid_request_error", "lora_name", "not_found"
        )
    if req.lora_name in ctx.model_names:
        raise bad_request(f"{req.lora_name!r} is the base model's name", "lora_name")
    try:
        answer = await ctx.client.update_lora(req.lora_name, path)
    except EngineDeadError as e:
        raise engine_error(e) from None
    if answer.error is not None:
        if answer.param is None:
            raise APIError(500, answer.error, "internal_server_error", None, "lora_update_failed")
        raise bad_request(answer.error, answer.param)
    if path is None:
        ctx.loras.pop(req.lora_name)
    else:
        ctx.loras[req.lora_name] = path
    return JSONResponse({"status": "ok", "lora_name": req.lora_name, "loaded": path is not None})
