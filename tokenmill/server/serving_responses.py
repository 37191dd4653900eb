"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

The request becomes a `ChatCompletionRequest` (protocol_responses.py) and runs as a chat completion
(`serving_chat.start_chat`: the same template, limits, tools, constraints and reasoning split); the
output's blocks (output_blocks.py) become output items: `reasoning` (with --reasoning-parser),
`message` (one `output_text` part) and `function_call`. A stream sends the Responses event types
(response.created, response.output_item.added, response.output_text.delta, ...,
response.completed); the full response is built by the same `ResponseBuilder` from the same events.

`previous_response_id` puts a stored response's conversation (its input, without its instructions, and
its output) before the new input. `ResponseStore` keeps the last --max-stored-responses of them in this
process's memory (least recently used dropped first; lost on restart); `store: false` keeps none.
Behind `tokenmill router` the ids name the replica (`resp_r<I>_...`) so that the router sends the next
request to the replica holding its conversation.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.output_blocks import Block, BlockEvent, ChatRun, OutputTotals
from tokenmill.server.protocol import APIError, bad_request
from tokenmill.server.protocol_responses import RENAMES, ResponsesRequest
from tokenmill.server.serving import ENGINE_ERRORS, ServingContext
from tokenmill.server.streaming import SSEResponse, sse


class ResponseStore:
    """Conversations of stored responses by id, at most `capacity` (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def get(self, response_id: str) -> list[dict]:
        conversation = self._conversations.get(response_id)
        if conversation is None:
            raise bad_request(
                f"previous_response_id {response_id[:80]!r} is not a stored response (this server keeps the "
                f"last {self.capacity}, in memory)",
                "previous_response_id",
                "not_found",
            )
        self._conversations.move_to_end(response_id)
        return conversation

    def put(self, response_id: str, conversation: list[dict]) -> None:
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)


def _replica_tag(request: Request) -> str:
    """`r<I>_` behind `tokenmill router`, which says which of its replicas this is: the router sends a
    request naming a response to the replica that stored it (`router.upstream.pinned_replica`)."""
    replica = request.headers.get("x-tokenmill-replica", "")
    return f"r{replica}_" if replica.isascii() and replica.isdigit() and len(replica) <= 4 else ""


async def create_response(
    ctx: ServingContext, req: ResponsesRequest, request: Request, arrival: float, store: ResponseStore
) -> Response:
    history = store.get(req.previous_response_id) if req.previous_response_id is not None else []
    conversation = history + req.input_messages()
    chat = req.chat_request(conversation)
    model = ctx.check_model(req.model)
    response_id = f"resp_{_replica_tag(request)}{uuid.uuid4().hex}"
    run = await ChatRun.start(ctx, chat, response_id, arrival, RENAMES, request)
    builder = ResponseBuilder(_response_object(req, response_id, model))
    remember = (lambda: store.put(response_id, conversation + [builder.assistant_message()])) if req.store else None
    if req.stream:
        return SSEResponse(_stream(run, builder, remember), on_close=run.stream.close)
    events = await run.whole(request)
    if events is None:
        return Response(status_code=499)
    builder.start()
    for event in events:
        builder.on_block(event, run.totals)
    builder.finish(run.totals, run.reasoning_tokens())
    if remember is not None:
        remember()
    return JSONResponse(builder.response)


async def _stream(run: ChatRun, builder: ResponseBuilder, remember):
    try:
        for event in builder.start():
            yield sse(event, event["type"])
        async for block_event in run.events():
            for event in builder.on_block(block_event, run.totals):
                yield sse(event, event["type"])
        for event in builder.finish(run.totals, run.reasoning_tokens()):
            yield sse(event, event["type"])
        if remember is not None:
            remember()
    except ENGINE_ERRORS as e:
        for event in builder.fail(run.error(e)):
            yield sse(event, event["type"])
    finally:
        run.stream.close()


class ResponseBuilder:
    """Block events -> the response object (`response`, complete after `finish`) and the stream
    events that build it, each numbered (`sequence_number`)."""

    def __init__(self, response: dict) -> None:
        self.response = response
        self._seq = 0
        self._ids: list[str] = []  # output index -> item id

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def on_block(self, e: BlockEvent, totals: OutputTotals) -> list[dict]:
        b = e.block
        where = {"output_index": b.index}
        if e.kind == "start":
            self._ids.append(f"{_ID_PREFIX[b.kind]}_{uuid.uuid4().hex}")
            item = _item(b, self._ids[b.index], "in_progress", "")
            self.response["output"].append(item)
            events = [self._event("response.output_item.added", **where, item=item)]
            if b.kind != "tool_call":
                part = _part(b.kind, "")
                events.append(
                    self._event("response.content_part.added", item_id=item["id"], **where, content_index=0, part=part)
                )
            return events
        item_id = self._ids[b.index]
        if e.kind == "delta":
            if b.kind == "tool_call":
                return [self._event("response.function_call_arguments.delta", item_id=item_id, **where, delta=e.text)]
            extra = {"logprobs": []} if b.kind == "text" else {}
            kind = "response.output_text.delta" if b.kind == "text" else "response.reasoning_text.delta"
            return [self._event(kind, item_id=item_id, **where, content_index=0, delta=e.text, **extra)]
        status = "incomplete" if e.final and totals.finish_reason == "length" else "completed"
        item = self.response["output"][b.index] = _item(b, item_id, status, b.text)
        if b.kind == "tool_call":
            events = [
                self._event(
                    "response.function_call_arguments.done", item_id=item_id, **where, name=b.name, arguments=b.text
                )
            ]
        else:
            extra = {"logprobs": []} if b.kind == "text" else {}
            kind = "response.output_text.done" if b.kind == "text" else "response.reasoning_text.done"
            events = [
                self._event(kind, item_id=item_id, **where, content_index=0, text=b.text, **extra),
                self._event(
                    "response.content_part.done", item_id=item_id, **where, content_index=0, part=_part(b.kind, b.text)
                ),
            ]
        return events + [self._event("response.output_item.done", **where, item=item)]

    def finish(self, totals: OutputTotals, reasoning: int) -> list[dict]:
        completion = len(totals.token_ids)
        incomplete = totals.finish_reason == "length"
        self.response.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            completed_at=None if incomplete else int(time.time()),
            usage={
                "input_tokens": totals.prompt_tokens,
                "input_tokens_details": {"cached_tokens": totals.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": totals.prompt_tokens + completion,
            },
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        return [self._event(kind, response=self._snapshot())]

    def fail(self, e: APIError) -> list[dict]:
        """A stream that ended with an error: the API's `error` event, then response.failed."""
        self.response.update(status="failed", error={"code": e.code or e.type, "message": e.message})
        return [
            self._event("error", code=e.code, message=e.message, param=e.param),
            self._event("response.failed", response=self._snapshot()),
        ]

    def assistant_message(self) -> dict:
        """The output as a chat message (text and tool calls; thinking is not sent back to a model)."""
        message: dict = {"role": "assistant", "content": ""}
        for item in self.response["output"]:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            elif item["type"] == "function_call":
                call = {"name": item["name"], "arguments": item["arguments"]}
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        return message

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return dict(self.response, output=list(self.response["output"]))


_ID_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def _part(kind: str, text: str) -> dict:
    if kind == "text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _item(b: Block, item_id: str, status: str, text: str) -> dict:
    if b.kind == "tool_call":
        return {
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": b.call_id,
            "name": b.name,
            "arguments": text,
        }
    parts = [_part(b.kind, text)] if status != "in_progress" else []
    if b.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": parts}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}


def _response_object(req: ResponsesRequest, response_id: str, model: str) -> dict:
    """The response as it starts (status in_progress, no output), echoing the request's settings."""
    choice = req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
        "tools": req.tools or [],
        "text": {"format": (req.text.format if req.text and req.text.format else None) or {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }
