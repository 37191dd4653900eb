"""POST /v1/chat/completions: messages -> the model's chat template -> an assistant reply."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.engine_client import EngineDeadError, RequestRejected, RequestStream
from tokenmill.server.protocol import ChatCompletionRequest, bad_request
from tokenmill.server.serving import ServingContext, engine_error, usage
from tokenmill.server.streaming import ClientDisconnected, SSEResponse, run_until_disconnect, sse


def chat_prompt_ids(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template that refuses the conversation (roles, missing template, ...)
        raise bad_request(f"messages cannot be formatted with the model's chat template: {e}", "messages") from None


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request,
                                 arrival: float) -> Response:
    model = ctx.check_model(req.model)
    params = req.sampling_params()
    ids = chat_prompt_ids(ctx, req.chat_messages(), req.add_generation_prompt)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = ctx.fit_to_context(len(ids), params, "messages", max_param)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = ctx.submit(request_id, None, ids, params, arrival, req.priority, req.cache_salt)
    top_n = req.top_logprobs or 0
    if req.stream:
        return SSEResponse(_stream(ctx, req, request_id, model, created, len(ids), stream, top_n),
                           on_close=stream.close)
    try:
        final = await run_until_disconnect(request, _last(stream))
    except ClientDisconnected:
        return Response(status_code=499)
    except (EngineDeadError, RequestRejected) as e:
        raise engine_error(e) from None
    finally:
        stream.close()
    choices = []
    for o in final.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": ctx.chat_logprobs(o.token_ids, o.logprobs or [], top_n), "refusal": None}
        choices.append({"index": o.index, "message": {"role": "assistant", "content": o.text, "refusal": None},
                        "logprobs": logprobs, "finish_reason": o.finish_reason})
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                         "system_fingerprint": None, "choices": choices,
                         "usage": usage(len(ids), completion_tokens, final.num_cached_tokens)})


async def _last(stream: RequestStream):
    last = None
    async for out in stream:
        last = out
    return last


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, model: str, created: int,
                  num_prompt: int, stream: RequestStream, top_n: int):
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}
    include_usage = req.include_usage

    def chunk(index: int, delta: dict, logprobs, finish_reason) -> str:
        body = dict(base, choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish_reason}])
        if include_usage:
            body["usage"] = None
        return sse(body)

    completion_tokens = cached = 0
    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for out in stream:
            cached = out.num_cached_tokens
            for d in out.deltas:
                completion_tokens += len(d.token_ids)
                logprobs = None
                if req.logprobs and d.logprobs:
                    logprobs = {"content": ctx.chat_logprobs(d.token_ids, d.logprobs, top_n), "refusal": None}
                if d.text or logprobs is not None or d.finish_reason is not None:
                    yield chunk(d.index, {"content": d.text} if d.text else {}, logprobs, d.finish_reason)
        if include_usage:
            yield sse(dict(base, choices=[], usage=usage(num_prompt, completion_tokens, cached)))
    except (EngineDeadError, RequestRejected) as e:
        yield sse(engine_error(e).to_dict())
    finally:
        stream.close()
    yield "data: [DONE]\n\n"
