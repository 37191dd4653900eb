"""POST /v1/completions: prompts (text, token ids, or lists of either) -> completions, streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.protocol import CompletionRequest, bad_request
from tokenmill.server.request_stream import RequestStream, StreamOutput
from tokenmill.server.serving import ENGINE_ERRORS, ServingContext, engine_error, merge_logprobs, usage, wait_started
from tokenmill.server.streaming import (
    ClientDisconnected,
    SSEResponse,
    choice_chunk_builder,
    gather_or_cancel,
    merge_streams,
    object_head,
    run_until_disconnect,
    sse,
)


def split_prompts(prompt) -> list:
    """The request's prompts: one text, one token-id list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def prompt_inputs(ctx: ServingContext, prompts: list, param: str = "prompt") -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt. Token-id prompts get their decoded text (for echo)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, ctx.encode(p, param)))
        else:
            ctx.check_token_ids(p, param)
            out.append((ctx.tokenizer.decode(p, skip_special_tokens=False), list(p)))
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request, arrival: float) -> Response:
    model = ctx.check_model(req.model)
    raw_prompts = split_prompts(req.prompt)
    ctx.check_limits(req, len(raw_prompts))
    for p in raw_prompts:
        ctx.check_prompt_size(p, "prompt")
    params = dataclasses.replace(req.sampling_params(), lora_name=ctx.lora_of(model))
    spec = req.structured_spec()
    if spec is not None:
        await ctx.check_structured(*spec)
    prompts = await ctx.off_loop("prompt", prompt_inputs, ctx, raw_prompts)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    items = []
    for i, (text, ids) in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        items.append((rid, text, ids, ctx.fit_to_context(len(ids), params, "prompt")))
    head = object_head(request_id, "text_completion", model, int(time.time()))
    streams = ctx.submit_all(items, arrival, req.priority, req.cache_salt)
    structured_param = spec[1] if spec else None
    await wait_started(streams, structured_param, request)
    if req.stream:
        events = _stream(ctx, req, head, prompts, streams, structured_param)
        return SSEResponse(events, on_close=lambda: [s.close() for s in streams])
    try:
        finals = await run_until_disconnect(request, gather_or_cancel(*(s.last() for s in streams)))
    except ClientDisconnected:
        return Response(status_code=499)
    except ENGINE_ERRORS as e:
        raise engine_error(e, structured_param) from None
    finally:
        for s in streams:
            s.close()
    return JSONResponse(_response(ctx, req, head, prompts, finals))


def _response(
    ctx: ServingContext,
    req: CompletionRequest,
    head: dict,
    prompts: list[tuple[str, list[int]]],
    finals: list[StreamOutput],
) -> dict:
    choices = []
    completion_tokens = cached = 0
    for p, (final, (text, ids)) in enumerate(zip(finals, prompts)):
        cached += final.num_cached_tokens
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            choices.append(
                dict(
                    _prompt_fields(ctx, req, ids, final.prompt_logprobs),
                    index=p * req.n + o.index,
                    text=(text if req.echo else "") + o.text,
                    finish_reason=o.finish_reason,
                )
            )
            if req.logprobs is not None:
                offset = choices[-1].pop("echo_offset")
                generated, _ = ctx.completion_logprobs(o.token_ids, o.logprobs or [], offset)
                choices[-1]["logprobs"] = merge_logprobs(choices[-1]["logprobs"], generated)
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return dict(head, choices=choices, usage=usage(prompt_tokens, completion_tokens, cached))


def _prompt_fields(ctx: ServingContext, req: CompletionRequest, ids: list[int], entries: list | None) -> dict:
    """A choice's prompt part: echoed-token logprobs (with `echo_offset`, where the generated text
    starts, when logprobs are asked) and vLLM's prompt_logprobs."""
    fields: dict = {"logprobs": None}
    if req.logprobs is not None:
        fields["logprobs"], fields["echo_offset"] = ctx.echo_logprobs(ids, entries) if req.echo else (None, 0)
    if req.prompt_logprobs is not None:
        fields["prompt_logprobs"] = ctx.vllm_prompt_logprobs(entries)
    return fields


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    head: dict,
    prompts: list[tuple[str, list[int]]],
    streams: list[RequestStream],
    structured_param: str | None,
):
    include_usage = req.include_usage
    chunk = choice_chunk_builder(head, include_usage, "text")

    offsets: dict[int, int] = {}
    completion_tokens = 0
    cached = [0] * len(prompts)
    # prompts whose first chunks (echo, prompt logprobs) wait for the engine's prompt logprobs
    waiting = {
        p
        for p in range(len(prompts))
        if req.engine_prompt_logprobs is not None and (req.logprobs is not None or req.prompt_logprobs is not None)
    }
    held: dict[int, list[StreamOutput]] = {p: [] for p in waiting}
    try:
        if req.echo:
            for p, (text, _) in enumerate(prompts):
                for j in range(req.n):
                    if p not in waiting:
                        yield chunk(p * req.n + j, text, None, None)
        async for p, out in merge_streams(streams):
            if p in waiting:
                if out.prompt_logprobs is None:
                    held[p].append(out)  # another sample went first: keep its deltas until the prompt's turn
                    continue
                waiting.discard(p)
                text, ids = prompts[p]
                for j in range(req.n):
                    fields = _prompt_fields(ctx, req, ids, out.prompt_logprobs)
                    offsets[p * req.n + j] = fields.pop("echo_offset", 0)
                    yield chunk(p * req.n + j, text if req.echo else "", finish_reason=None, **fields)
            for o in held.pop(p, []) + [out]:
                cached[p] = o.num_cached_tokens
                for d in o.deltas:
                    index = p * req.n + d.index
                    completion_tokens += len(d.token_ids)
                    logprobs = None
                    if req.logprobs is not None and d.logprobs:
                        logprobs, offsets[index] = ctx.completion_logprobs(
                            d.token_ids, d.logprobs, offsets.get(index, 0)
                        )
                    if d.text or logprobs is not None or d.finish_reason is not None:
                        yield chunk(index, d.text, logprobs, d.finish_reason)
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            yield sse(dict(head, choices=[], usage=usage(prompt_tokens, completion_tokens, sum(cached))))
    except ENGINE_ERRORS as e:  # the same error as a non-streamed request gets (a dead-end grammar: a 400)
        yield sse(engine_error(e, structured_param).to_dict())
    finally:
        for s in streams:
            s.close()
    yield "data: [DONE]\n\n"
