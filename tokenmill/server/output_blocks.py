"""A chat output as a sequence of blocks (thinking, text, tool calls), each opened, extended and closed
in order: what the Responses API's output items and the Messages API's content blocks both are.

The chat path's `ChatOutputParser` splits the output into message deltas (reasoning, content, tool
calls); `OutputBlocks` turns those into block events. `ChatRun` submits an API's request as a chat
request and gives its output as block events, streamed (`events`) or once finished (`whole`: the same
events from the whole text), so the Responses and Messages APIs build their full responses from the
very events they stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from tokenmill.server.protocol import APIError, ChatCompletionRequest, renamed
from tokenmill.server.request_stream import RequestStream
from tokenmill.server.serving import ServingContext, engine_error
from tokenmill.server.serving_chat import ChatOutputParser, ChatPlan, final_output, reasoning_tokens, start_chat


@dataclass
class Block:
    kind: str  # "reasoning" | "text" | "tool_call"
    index: int  # its position in the output
    text: str = ""  # the thinking or the text; a tool call's arguments (JSON text)
    name: str | None = None  # a tool call's function
    call_id: str | None = None


@dataclass
class BlockEvent:
    kind: str  # "start" | "delta" | "stop"
    block: Block
    text: str = ""  # a delta's text
    final: bool = False  # a "stop" that ends the output (the block a length limit cuts off)


@dataclass
class OutputTotals:
    """What an API reports once the output ended."""

    prompt_tokens: int
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # chat's: stop | length | tool_calls | abort
    stop_reason: str | int | None = None  # the stop string (or stop token) that ended it

    def finish(self, parser: ChatOutputParser, finish_reason: str | None, stop_reason: str | int | None) -> None:
        self.finish_reason = parser.finish_reason(finish_reason)
        self.stop_reason = stop_reason


class OutputBlocks:
    """Message deltas of one output -> block events. A new kind of text, or a new tool call, closes the
    open block; the tool parsers extend only the call they opened last."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, deltas: list[dict]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for d in deltas:
            for key, kind in (("reasoning_content", "reasoning"), ("content", "text")):
                if d.get(key):
                    if self._open is None or self._open.kind != kind:
                        self._start(events, kind)
                    self._extend(events, d[key])
            for call in d.get("tool_calls", []):
                if "id" in call:
                    self._start(events, "tool_call", call["function"]["name"], call["id"])
                if call["function"]["arguments"]:
                    self._extend(events, call["function"]["arguments"])
        return events

    def close(self, final: bool = False) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is not None:
            events.append(BlockEvent("stop", self._open, final=final))
            self._open = None
        return events

    def _start(self, events: list[BlockEvent], kind: str, name: str | None = None, call_id: str | None = None) -> None:
        events += self.close()
        self._open = Block(kind, len(self.blocks), name=name, call_id=call_id)
        self.blocks.append(self._open)
        events.append(BlockEvent("start", self._open))

    def _extend(self, events: list[BlockEvent], text: str) -> None:
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))


@dataclass
class ChatRun:
    """An API's request submitted as a chat request (one sample); the chat path's errors are renamed
    to that API's fields (`renames`, see `protocol.renamed`)."""

    ctx: ServingContext
    stream: RequestStream
    plan: ChatPlan
    parser: ChatOutputParser
    totals: OutputTotals
    renames: tuple[tuple[str, str], ...]

    @classmethod
    async def start(
        cls,
        ctx: ServingContext,
        chat: ChatCompletionRequest,
        request_id: str,
        arrival: float,
        renames,
        request: Request,
    ) -> ChatRun:
        try:
            stream, plan, ids = await start_chat(ctx, chat, request_id, arrival, request)
        except APIError as e:
            raise renamed(e, renames) from None
        parser = ChatOutputParser(ctx, plan, chat.parallel_tool_calls)
        return cls(ctx, stream, plan, parser, OutputTotals(len(ids)), renames)

    async def events(self) -> AsyncIterator[BlockEvent]:
        """The output as block events while it is made; `totals` is complete before the last block's
        "stop". The engine's errors pass through (`error` gives the API's)."""
        blocks = OutputBlocks()
        async for out in self.stream:
            self.totals.cached_tokens = out.num_cached_tokens
            for d in out.deltas:
                self.totals.token_ids += d.token_ids
                finished = d.finish_reason is not None
                events = blocks.feed(self.parser.feed(d.text, finished)) if d.text or finished else []
                if finished:
                    self.totals.finish(self.parser, d.finish_reason, d.stop_reason)
                    events += blocks.close(final=True)
                for event in events:
                    yield event

    async def whole(self, request: Request) -> list[BlockEvent] | None:
        """The finished output's block events, as `events` gives them; None if the client went away."""
        try:
            final = await final_output(request, self.stream, self.plan)
        except APIError as e:
            raise renamed(e, self.renames) from None
        if final is None:
            return None
        output = final.outputs[0]
        self.totals.cached_tokens = final.num_cached_tokens
        self.totals.token_ids = list(output.token_ids)
        blocks = OutputBlocks()
        events = blocks.feed(self.parser.feed(output.text, finished=True))
        self.totals.finish(self.parser, output.finish_reason, output.stop_reason)
        return events + blocks.close(final=True)

    def error(self, e: Exception) -> APIError:
        """The API's error for an engine failure during a stream."""
        return renamed(engine_error(e, self.plan.structured_param), self.renames)

    def reasoning_tokens(self) -> int:
        return reasoning_tokens(self.ctx, self.plan, [self.totals.token_ids]) or 0
