"""Anthropic Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), their
translation into a chat request, and Anthropic's error shape.

`system` (a string or text blocks), `messages` whose content is a string or blocks: `text`, `tool_use`
(an assistant's earlier calls), `tool_result` (their results: chat `tool` messages, before the user's
text) and `thinking` / `redacted_thinking` (earlier thinking: dropped, as chat drops an assistant's
`reasoning_content`). Custom tools (`input_schema`), `tool_choice` auto / any / tool / none,
`stop_sequences`, `output_config.format` (a JSON schema, through the structured-output engine),
`thinking` ({"type": "enabled", "budget_tokens"}: the thinking budget, with --reasoning-parser;
enabled / adaptive / disabled also set the template's `enable_thinking`). The SDK no longer sends
`temperature` / `top_p` / `top_k`, but the API still takes them (`extra_body`). Errors name the
Messages field (`messages[1].content[0].tool_use_id`, `tools[0].input_schema`, `stop_sequences`, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field

from tokenmill.server.protocol import (
    CallId,
    ChatCompletionRequest,
    Priority,
    _Body,
    bad_request,
    parse_part,
    parse_tagged,
)

# chat field names -> the Messages API's, for the errors of the chat path (see `protocol.renamed`)
RENAMES = (
    (r"stop$", "stop_sequences"),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"max_reasoning_tokens", "thinking.budget_tokens"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: CallId
    name: str
    input: dict


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: CallId
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]


_BLOCKS = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class CustomTool(_Body):
    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    input_schema: dict


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # "enabled" only


class OutputConfig(_Body):
    format: dict | None = None  # {"type": "json_schema", "schema": ...}


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int | None = None  # required on /v1/messages (`chat_request`), not on count_tokens
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    metadata: dict | None = None
    priority: Priority = 0  # with --scheduling-policy priority (tokenmill, as vLLM's)

    def chat_request(self, reasoning_parser: str | None, need_max_tokens: bool = True) -> ChatCompletionRequest:
        """The chat request this is. Without a reasoning parser the model cannot think apart from its
        answer: `thinking` then only sets the template switch."""
        if need_max_tokens and self.max_tokens is None:
            raise bad_request("max_tokens is required", "max_tokens", "missing_field")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for i, m in enumerate(self.messages):
            messages += _chat_messages(m, f"messages[{i}]")
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "tools": [_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            "stream": self.stream,
            "priority": self.priority,
        }
        choice = self.tool_choice
        if choice is not None:
            if choice.type in ("any", "tool") and not self.tools:
                raise bad_request(f"tool_choice {choice.type!r} requires tools", "tool_choice")
            body["tool_choice"] = _chat_tool_choice(choice)
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            if fmt.get("type") != "json_schema":
                raise bad_request(
                    f"output_config.format.type must be 'json_schema', got {str(fmt.get('type'))[:40]!r}",
                    "output_config.format.type",
                )
            schema = {"schema": fmt["schema"]} if "schema" in fmt else {}
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", **schema}}
        if self.thinking is not None:
            budget = self.thinking.budget_tokens
            if budget is not None and self.max_tokens is not None and budget >= self.max_tokens:
                # as Anthropic's API: the thinking comes out of max_tokens, and the answer needs some
                raise bad_request(
                    f"max_tokens ({self.max_tokens}) must be greater than thinking.budget_tokens ({budget})",
                    "thinking.budget_tokens",
                )
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.type == "enabled" and reasoning_parser is not None:
                if self.thinking.budget_tokens is None:
                    raise bad_request("thinking.budget_tokens is required", "thinking.budget_tokens", "missing_field")
                body["max_reasoning_tokens"] = self.thinking.budget_tokens
        return ChatCompletionRequest.model_validate(body, strict=True)


def _chat_messages(m: InputMessage, path: str) -> list[dict]:
    """One Anthropic message as chat messages: tool results first (chat `tool` messages), then the
    text (with an assistant's tool calls)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text, calls, results = [], [], []
    for j, raw in enumerate(m.content):
        where = f"{path}.content[{j}]"
        block = parse_tagged(_BLOCKS, raw.get("type") if isinstance(raw, dict) else None, raw, where)
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise bad_request(f"{where}.type: tool_use blocks belong in assistant messages", f"{where}.type")
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise bad_request(f"{where}.type: tool_result blocks belong in user messages", f"{where}.type")
            content = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    out = results
    if text or calls or not results:
        message = {"role": m.role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out = out + [message]
    return out


def _chat_tool(raw, i: int) -> dict:
    path = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{path} must be an object", path)
    if raw.get("type", "custom") != "custom":
        raise bad_request(
            f"{path}.type {str(raw['type'])[:40]!r} is a server tool, which this server does not run; "
            "only custom tools (name, input_schema) are supported",
            f"{path}.type",
            "unsupported",
        )
    tool = parse_part(CustomTool, raw, path)
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice):
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
