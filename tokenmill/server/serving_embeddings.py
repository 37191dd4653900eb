"""POST /v1/embeddings: texts or token-id lists (one or a batch) -> L2-normalized embeddings, as floats
or base64 (little-endian float32, what the `openai` client decodes).

Each input runs through the engine like any request, as a prompt with nothing to generate
(`SamplingParams.pooling`, max_tokens 0): it shares batches with generation, its KV blocks return
when its prompt is done, and the engine hands back the pooled final hidden state. The model's
convention decides the pooling: a sentence-transformers `1_Pooling/config.json` beside the weights
that asks for mean pooling gets it, every other decoder the last token's state (Qwen3-Embedding's,
vLLM's default for decoders). `dimensions` (Matryoshka: keep the leading features, renormalize) only
for a model whose config.json declares it (`is_matryoshka` or `matryoshka_dimensions`).
"""

from __future__ import annotations

import base64
import functools
import json
import math
import sys
import time
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import EmbeddingRequest, bad_request
from tokenmill.server.serving import ENGINE_ERRORS, ServingContext, engine_error
from tokenmill.server.serving_completions import prompt_inputs
from tokenmill.server.streaming import ClientDisconnected, gather_or_cancel, run_until_disconnect


@dataclass(frozen=True)
class EmbeddingConvention:
    pooling: str = "last"  # "last" | "mean"
    matryoshka: bool = False  # whether `dimensions` may shorten the embedding
    matryoshka_dimensions: tuple[int, ...] = ()  # the lengths it was trained for (empty: any)


@functools.lru_cache(maxsize=8)
def embedding_convention(model_path: str) -> EmbeddingConvention:
    """What the model directory says about its embeddings (defaults for a GGUF file or a plain decoder)."""
    directory = Path(model_path)
    if not directory.is_dir():
        return EmbeddingConvention()
    config = _read_json(directory / "config.json")
    pooling = _read_json(directory / "1_Pooling" / "config.json")
    dims = tuple(config.get("matryoshka_dimensions") or ())
    return EmbeddingConvention(
        "mean" if pooling.get("pooling_mode_mean_tokens") and not pooling.get("pooling_mode_lasttoken") else "last",
        bool(config.get("is_matryoshka") or dims),
        dims,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, request: Request, arrival: float) -> Response:
    model = ctx.check_model(req.model)
    convention = embedding_convention(ctx.client.info.get("model_path", ""))
    _check_dimensions(req.dimensions, convention, ctx.client.info.get("hidden_size"))
    inputs = _split_inputs(req.input)
    if len(inputs) > ctx.limits.max_prompts:
        raise bad_request(f"input has {len(inputs)} items; at most {ctx.limits.max_prompts} are allowed", "input")
    for p in inputs:
        ctx.check_prompt_size(p, "input")
    prompts = await ctx.off_loop("input", prompt_inputs, ctx, inputs, "input")
    params = SamplingParams(max_tokens=0, pooling=convention.pooling, lora_name=ctx.lora_of(model))
    request_id = f"embd-{uuid.uuid4().hex}"
    items = []
    for i, (text, ids) in enumerate(prompts):
        if not ids:
            raise bad_request(f"input[{i}] has no tokens", "input")
        if len(ids) > ctx.context_limit:
            raise bad_request(
                f"input[{i}] has {len(ids)} tokens; this model's limit is {ctx.context_limit}",
                "input",
                "context_length_exceeded",
            )
        items.append((f"{request_id}-{i}", text, ids, params))
    streams = ctx.submit_all(items, arrival, req.priority)
    try:
        finals = await run_until_disconnect(request, gather_or_cancel(*(s.last() for s in streams)))
    except ClientDisconnected:
        return Response(status_code=499)
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    finally:
        for s in streams:
            s.close()
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encode(_normalize(f.pooled, req.dimensions), req.encoding_format),
        }
        for i, f in enumerate(finals)
    ]
    num_tokens = sum(len(ids) for _, ids in prompts)
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )


def _split_inputs(value) -> list:
    """The request's inputs: one text, one token-id list, or a list of either."""
    if isinstance(value, str):
        value = [value]
    elif value and isinstance(value[0], int):
        value = [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(value):
        if not item:
            raise bad_request(f"input[{i}] must not be empty", "input")
    return list(value)


def _check_dimensions(dimensions: int | None, convention: EmbeddingConvention, hidden_size: int | None) -> None:
    if dimensions is None:
        return
    if not convention.matryoshka:
        raise bad_request("dimensions: this model does not support Matryoshka embeddings (shorter ones)", "dimensions")
    if convention.matryoshka_dimensions and dimensions not in convention.matryoshka_dimensions:
        raise bad_request(f"dimensions must be one of {list(convention.matryoshka_dimensions)}", "dimensions")
    if not 1 <= dimensions <= (hidden_size or dimensions):
        raise bad_request(f"dimensions must be in [1, {hidden_size}], got {dimensions}", "dimensions")


def _normalize(vector: list[float], dimensions: int | None) -> list[float]:
    """The leading `dimensions` features (all without), scaled to unit length."""
    if dimensions is not None:
        vector = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    floats = array("f", vector)  # float32
    if sys.byteorder == "big":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode("ascii")
