"""A chat output as a sequence of blocks (thinking, text, tool calls), each opened, extended and closed
in order: what the Responses API's output items and the Messages API's content blocks both are.

The chat path's `ChatOutputParser` splits the output into message deltas (reasoning, content, tool
calls); `OutputBlocks` turns those into block events. `stream_blocks` runs a request's stream through
both; `whole_output` runs a finished output through the same two, so the Responses and Messages APIs
build their full responses from the very events they stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.engine.output_processor import CompletionOutput
from tokenmill.server.request_stream import RequestStream
from tokenmill.server.serving_chat import ChatOutputParser


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


async def stream_blocks(
    parser: ChatOutputParser, stream: RequestStream, totals: OutputTotals
) -> AsyncIterator[BlockEvent]:
    """A one-sample request's output as block events; `totals` is complete before the last block's
    "stop" (the engine's errors pass through)."""
    blocks = OutputBlocks()
    async for out in stream:
        totals.cached_tokens = out.num_cached_tokens
        for d in out.deltas:
            totals.token_ids += d.token_ids
            finished = d.finish_reason is not None
            events = blocks.feed(parser.feed(d.text, finished)) if d.text or finished else []
            if finished:
                totals.finish(parser, d.finish_reason, d.stop_reason)
                events += blocks.close(final=True)
            for event in events:
                yield event


def whole_output(parser: ChatOutputParser, output: CompletionOutput, totals: OutputTotals) -> list[BlockEvent]:
    """A finished output's block events, as `stream_blocks` gives them."""
    blocks = OutputBlocks()
    totals.token_ids = list(output.token_ids)
    events = blocks.feed(parser.feed(output.text, finished=True))
    totals.finish(parser, output.finish_reason, output.stop_reason)
    return events + blocks.close(final=True)
