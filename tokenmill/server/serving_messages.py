"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served by the chat path.

The request becomes a `ChatCompletionRequest` (protocol_anthropic.py) and runs as a chat completion
(`serving_chat.start_chat`); the output's blocks (output_blocks.py) become content blocks: `thinking`
(with --reasoning-parser; the signature is empty), `text` and `tool_use`. A stream sends Anthropic's
events (message_start, content_block_start / _delta / _stop, message_delta, message_stop); the full
message is built by the same `MessageBuilder` from the same events. Usage follows Anthropic: prompt
tokens served from the prefix cache are `cache_read_input_tokens`, the rest `input_tokens`.
"""

from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.http_front import anthropic_error
from tokenmill.server.output_blocks import BlockEvent, ChatRun, OutputTotals
from tokenmill.server.protocol import APIError, renamed
from tokenmill.server.protocol_anthropic import RENAMES, MessagesRequest
from tokenmill.server.serving import ENGINE_ERRORS, ServingContext
from tokenmill.server.serving_chat import prepare_chat
from tokenmill.server.streaming import SSEResponse, sse


async def create_message(ctx: ServingContext, req: MessagesRequest, request: Request, arrival: float) -> Response:
    chat = req.chat_request(ctx.reasoning_parser)
    model = ctx.check_model(req.model)
    message_id = f"msg_{uuid.uuid4().hex}"
    run = await ChatRun.start(ctx, chat, message_id, arrival, RENAMES, request)
    builder = MessageBuilder(message_id, model, run.totals.prompt_tokens)
    if req.stream:
        return SSEResponse(_stream(run, builder), on_close=run.stream.close)
    events = await run.whole(request)
    if events is None:
        return Response(status_code=499)
    for event in events:
        builder.on_block(event)
    builder.finish(run.totals)
    return JSONResponse(builder.message)


async def count_message_tokens(ctx: ServingContext, req: MessagesRequest) -> Response:
    """The prompt's tokens as /v1/messages would render it (system, tools, messages)."""
    chat = req.chat_request(ctx.reasoning_parser, need_max_tokens=False)
    ctx.check_model(req.model)
    try:
        _, ids, _ = await prepare_chat(ctx, chat)
    except APIError as e:
        raise renamed(e, RENAMES) from None
    return JSONResponse({"input_tokens": len(ids)})


async def _stream(run: ChatRun, builder: MessageBuilder):
    try:
        yield _sse(builder.start())
        async for block_event in run.events():
            for event in builder.on_block(block_event):
                yield _sse(event)
        for event in builder.finish(run.totals):
            yield _sse(event)
    except ENGINE_ERRORS as e:
        yield _sse(anthropic_error(run.error(e)))
    finally:
        run.stream.close()


def _sse(event: dict) -> str:
    return sse(event, event["type"])


class MessageBuilder:
    """Block events -> the message (`message`, complete after `finish`) and the stream events that
    build it."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }

    def start(self) -> dict:
        return {"type": "message_start", "message": dict(self.message, content=[])}

    def on_block(self, e: BlockEvent) -> list[dict]:
        b = e.block
        if e.kind == "start":
            if b.kind == "tool_call":
                block = {
                    "type": "tool_use",
                    "id": "toolu_" + b.call_id.removeprefix("call_"),
                    "name": b.name,
                    "input": {},
                }
            elif b.kind == "reasoning":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                block = {"type": "text", "text": ""}
            self.message["content"].append(block)
            return [{"type": "content_block_start", "index": b.index, "content_block": dict(block)}]
        block = self.message["content"][b.index]
        if e.kind == "delta":
            if b.kind == "tool_call":
                delta = {"type": "input_json_delta", "partial_json": e.text}
            elif b.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": e.text}
            else:
                delta = {"type": "text_delta", "text": e.text}
            return [{"type": "content_block_delta", "index": b.index, "delta": delta}]
        if b.kind == "tool_call":
            block["input"] = _arguments(b.text)
        else:
            block["thinking" if b.kind == "reasoning" else "text"] = b.text
        return [{"type": "content_block_stop", "index": b.index}]

    def finish(self, totals: OutputTotals) -> list[dict]:
        stop_reason, stop_sequence = {"tool_calls": "tool_use", "length": "max_tokens"}.get(totals.finish_reason), None
        if stop_reason is None:
            if isinstance(totals.stop_reason, str):
                stop_reason, stop_sequence = "stop_sequence", totals.stop_reason
            else:
                stop_reason = "end_turn"
        usage = {
            "input_tokens": totals.prompt_tokens - totals.cached_tokens,
            "output_tokens": len(totals.token_ids),
            "cache_read_input_tokens": totals.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
        self.message.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=usage)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]


def _arguments(text: str) -> dict:
    """A tool call's arguments as its `input` object ({} if they were cut off before they closed)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
