"""POST /v1/chat/completions: messages -> the model's chat template -> an assistant reply.

With tools, the prompt and the output follow `tokenmill.structured.tools` (tool_choice `required` or a
named function constrains the output to the tools' schemas). With `--reasoning-parser`, the output is
split into `reasoning_content` and `content`, and any output constraint starts after the thinking.
Per choice, one `ChatOutputParser` turns text deltas into message deltas, for streams and full
responses alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import APIError, ChatCompletionRequest, bad_request
from tokenmill.server.request_stream import RequestStream
from tokenmill.server.serving import (
    ENGINE_ERRORS,
    ServingContext,
    count_reasoning_tokens,
    engine_error,
    usage,
    wait_started,
)
from tokenmill.server.streaming import (
    ClientDisconnected,
    SSEResponse,
    choice_chunk_builder,
    object_head,
    run_until_disconnect,
    sse,
)
from tokenmill.structured import tools as tool_fmt
from tokenmill.structured.reasoning import REASONING_PARSERS, prompt_closes_reasoning
from tokenmill.structured.spec import ReasoningSpec, StructuredOutputSpec

logger = logging.getLogger(__name__)


def _text_chars(value) -> int:
    """The characters of every string in a JSON-like value (messages, tools): what a rendered prompt holds
    at least."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


async def chat_prompt_ids(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return (await chat_prompt(ctx, messages, add_generation_prompt))[1]


async def chat_prompt(
    ctx: ServingContext,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools=None,
    template_kwargs: dict | None = None,
) -> tuple[str, list[int]]:
    """The rendered prompt text and its token ids (rendered off the event loop, under a time limit)."""
    ctx.check_text_fits(_text_chars(messages) + _text_chars(tools), "messages")

    def render() -> tuple[str, list[int]]:
        text = ctx.tokenizer.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {})
        )
        return text, ctx.encode(text, "messages", add_special_tokens=False)

    try:
        return await ctx.off_loop("messages", render)
    except APIError:
        raise
    except Exception as e:  # a template that refuses the conversation (roles, missing template, ...)
        raise bad_request(
            f"messages cannot be formatted with the model's chat template: {template_error(e)}", "messages"
        ) from None


def template_error(e: Exception) -> str:
    """What a client may see of a template failure: the template's own `raise_exception` messages (they
    are written for users) and our own checks; anything else is logged, not echoed."""
    from jinja2.exceptions import TemplateError

    if type(e) is TemplateError or isinstance(e, ValueError):
        return str(e)[:300]
    logger.warning("chat template failed: %s: %s", type(e).__name__, e)
    return "the template failed on these messages"


@dataclasses.dataclass
class ChatPlan:
    """How one chat request is prompted, constrained and parsed."""

    tool_mode: str  # none | auto | required | named
    tool_name: str | None
    tools: list[dict]
    in_reasoning: bool  # the output starts inside the model's thinking (reasoning parser on)
    structured_param: str | None  # the request field the output constraint came from
    reasoning_end_ids: tuple[int, ...] = ()  # the end-of-thinking marker's tokens (reasoning parser on)


class ChatOutputParser:
    """One choice's output: text deltas -> message deltas (reasoning, content, tool calls)."""

    def __init__(self, ctx: ServingContext, plan: ChatPlan, parallel_tool_calls: bool) -> None:
        self.reasoning = None
        if ctx.reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[ctx.reasoning_parser](plan.in_reasoning)
        mode = plan.tool_mode
        self.tools = (
            tool_fmt.HermesToolParser(parallel_tool_calls)
            if mode == "auto"
            else tool_fmt.NamedToolParser(plan.tool_name)
            if mode == "named"
            else tool_fmt.ArrayToolParser()
            if mode == "required"
            else None
        )
        self.num_calls = 0

    def feed(self, text: str, finished: bool = False) -> list[dict]:
        deltas: list[dict] = []
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if finished and self.reasoning is not None:
            r2, c2 = self.reasoning.finish()
            reasoning, content = reasoning + r2, content + c2
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        if self.tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        events = self.tools.feed(content) if content else []
        if finished:
            events += self.tools.finish()
        for event in events:
            if event[0] == "content":
                deltas.append({"content": event[1]})
            elif event[0] == "call":
                self.num_calls += 1
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": event[1],
                                "id": f"call_{uuid.uuid4().hex[:24]}",
                                "type": "function",
                                "function": {"name": event[2], "arguments": ""},
                            }
                        ]
                    }
                )
            elif event[2]:
                deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return _merge(deltas)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def _merge(deltas: list[dict]) -> list[dict]:
    """Join neighbouring text deltas of the same kind (fewer stream chunks)."""
    out: list[dict] = []
    for d in deltas:
        if out and len(d) == 1 and set(d) == set(out[-1]) and next(iter(d)) in ("content", "reasoning_content"):
            key = next(iter(d))
            out[-1] = {key: out[-1][key] + d[key]}
        else:
            out.append(d)
    return out


def _message(deltas: list[dict], with_reasoning: bool, with_tools: bool) -> dict:
    """A whole assistant message from all of a choice's deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls.append(
                    {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}}
                )
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    message = {"role": "assistant", "content": content or (None if calls or with_reasoning else ""), "refusal": None}
    if with_reasoning:
        message["reasoning_content"] = reasoning or None
    if with_tools:
        message["tool_calls"] = calls
    return message


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[SamplingParams, list[int], ChatPlan]:
    """Prompt ids, sampling parameters (with constraints) and the parsing plan of a chat request."""
    ctx.check_limits(req)
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is supported on non-streamed chat completions only", "prompt_logprobs", "unsupported"
        )
    params = req.sampling_params()
    template_kwargs = req.template_kwargs()
    mode, name = req.tool_mode()
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    spec = req.structured_spec()
    for i, tool in enumerate(tools):
        if "parameters" in tool["function"]:
            await ctx.check_structured(
                StructuredOutputSpec.json(tool["function"]["parameters"]), f"tools[{i}].function.parameters"
            )
    if mode in ("required", "named"):
        if spec is not None:
            raise bad_request(
                f"{spec[1]} cannot be combined with tool_choice {mode if mode != 'named' else name!r}: "
                "the output is constrained to the tool call",
                spec[1],
            )
        chosen = [t for t in tools if t["function"]["name"] == name]
        schema = (
            tool_fmt.parameters_schema(chosen[0])
            if mode == "named"
            else tool_fmt.required_schema(tools, req.parallel_tool_calls)
        )
        spec = (StructuredOutputSpec.json(schema), "tools")
        await ctx.check_structured(*spec)
        params = dataclasses.replace(params, structured_output=spec[0])
    elif spec is not None:
        await ctx.check_structured(*spec)

    native = tool_fmt.template_supports_tools(ctx.tokenizer.hf.chat_template)
    prompt_tools = tools if mode != "none" else None
    messages = tool_fmt.render_messages(req.chat_messages(), prompt_tools, native)
    text, ids = await chat_prompt(
        ctx, messages, req.add_generation_prompt, prompt_tools if native else None, template_kwargs
    )

    in_reasoning, end_ids = False, ()
    if ctx.reasoning_parser is not None:
        parser = REASONING_PARSERS[ctx.reasoning_parser]
        in_reasoning = not prompt_closes_reasoning(text, parser.start, parser.end)
        end_ids = tuple(ctx.tokenizer.encode(parser.end, add_special_tokens=False))
        if in_reasoning and (params.structured_output is not None or req.max_reasoning_tokens is not None):
            params = dataclasses.replace(
                params, reasoning=ReasoningSpec(parser.end, end_ids, True, req.max_reasoning_tokens)
            )
    elif req.max_reasoning_tokens is not None:
        raise bad_request(
            "max_reasoning_tokens needs a reasoning model: start the server with --reasoning-parser",
            "max_reasoning_tokens",
        )
    return params, ids, ChatPlan(mode, name, tools, in_reasoning, spec[1] if spec else None, end_ids)


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, request: Request, arrival: float
) -> Response:
    model = ctx.check_model(req.model)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream, plan, ids = await start_chat(ctx, req, request_id, arrival, request)
    top_n = req.top_logprobs or 0
    if req.stream:
        return SSEResponse(
            _stream(ctx, req, plan, request_id, model, created, len(ids), stream, top_n), on_close=stream.close
        )
    final = await final_output(request, stream, plan)
    if final is None:
        return Response(status_code=499)
    choices = []
    for o in final.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": ctx.chat_logprobs(o.token_ids, o.logprobs or [], top_n), "refusal": None}
        parser = ChatOutputParser(ctx, plan, req.parallel_tool_calls)
        message = _message(
            parser.feed(o.text, finished=True), ctx.reasoning_parser is not None, plan.tool_mode != "none"
        )
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": parser.finish_reason(o.finish_reason),
            }
        )
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    extra = (
        {"prompt_logprobs": ctx.vllm_prompt_logprobs(final.prompt_logprobs)} if req.prompt_logprobs is not None else {}
    )
    return JSONResponse(
        {
            **object_head(request_id, "chat.completion", model, created),
            "choices": choices,
            **extra,
            "usage": usage(
                len(ids),
                completion_tokens,
                final.num_cached_tokens,
                reasoning_tokens(ctx, plan, [o.token_ids for o in final.outputs]),
            ),
        }
    )


def reasoning_tokens(ctx: ServingContext, plan: ChatPlan, outputs: list[list[int]]) -> int | None:
    """completion_tokens_details.reasoning_tokens, with a reasoning parser (else None: not reported)."""
    if ctx.reasoning_parser is None:
        return None
    return sum(count_reasoning_tokens(ids, plan.reasoning_end_ids, plan.in_reasoning) for ids in outputs)


async def start_chat(
    ctx: ServingContext, req: ChatCompletionRequest, request_id: str, arrival: float, request: Request
) -> tuple[RequestStream, ChatPlan, list[int]]:
    """Prepare a chat request and submit it: its stream (started, when constrained: a grammar the engine
    refuses is still a 400 here), its plan and its prompt ids. The Responses and Messages APIs come
    through here too, their requests turned into a `ChatCompletionRequest`."""
    params, ids, plan = await prepare_chat(ctx, req)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = ctx.fit_to_context(
        len(ids), dataclasses.replace(params, lora_name=ctx.lora_of(req.model)), "messages", max_param
    )
    stream = ctx.submit(request_id, None, ids, params, arrival, req.priority, req.cache_salt)
    await wait_started([stream], plan.structured_param, request)
    return stream, plan, ids


async def final_output(request: Request, stream: RequestStream, plan: ChatPlan):
    """The request's last output once it finished; None if the client went away first (the request is
    aborted: its stream is closed however this ends)."""
    try:
        return await run_until_disconnect(request, stream.last())
    except ClientDisconnected:
        return None
    except ENGINE_ERRORS as e:
        raise engine_error(e, plan.structured_param) from None
    finally:
        stream.close()


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    plan: ChatPlan,
    request_id: str,
    model: str,
    created: int,
    num_prompt: int,
    stream: RequestStream,
    top_n: int,
):
    head = object_head(request_id, "chat.completion.chunk", model, created)
    include_usage = req.include_usage
    chunk = choice_chunk_builder(head, include_usage, "delta")

    parsers = [ChatOutputParser(ctx, plan, req.parallel_tool_calls) for _ in range(req.n)]
    completion_tokens = cached = 0
    tokens: list[list[int]] = [[] for _ in range(req.n)]
    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for out in stream:
            cached = out.num_cached_tokens
            for d in out.deltas:
                completion_tokens += len(d.token_ids)
                tokens[d.index] += d.token_ids
                logprobs = None
                if req.logprobs and d.logprobs:
                    logprobs = {"content": ctx.chat_logprobs(d.token_ids, d.logprobs, top_n), "refusal": None}
                parser = parsers[d.index]
                finished = d.finish_reason is not None
                deltas = parser.feed(d.text, finished) if d.text or finished else []
                finish = parser.finish_reason(d.finish_reason)
                if not deltas and (logprobs is not None or finished):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    yield chunk(d.index, delta, logprobs if k == 0 else None, finish if k == len(deltas) - 1 else None)
        if include_usage:
            yield sse(
                dict(
                    head,
                    choices=[],
                    usage=usage(num_prompt, completion_tokens, cached, reasoning_tokens(ctx, plan, tokens)),
                )
            )
    except ENGINE_ERRORS as e:  # the same error as a non-streamed request gets (a dead-end grammar: a 400)
        yield sse(engine_error(e, plan.structured_param).to_dict())
    finally:
        stream.close()
    yield "data: [DONE]\n\n"
