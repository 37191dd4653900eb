"""OpenAI Responses API request bodies (`POST /v1/responses`) and their translation into a chat request.

`input` is a string (one user message) or a list of items: messages (`input_text` / `output_text`
parts), `function_call` items (a model's earlier calls), `function_call_output` items (their results)
and `reasoning` items (earlier thinking: dropped, as chat drops an assistant's `reasoning_content`).
Function tools are OpenAI's flat form (`{"type": "function", "name", "parameters"}`); `text.format` is a
JSON schema or JSON object constraint; `reasoning.effort` goes to the chat template as
`reasoning_effort`; `max_reasoning_tokens` is tokenmill's thinking budget as on chat. Errors name the
Responses field (`input[2].call_id`, `tools[0].parameters`, `text.format.schema`, ...).
"""

from __future__ import annotations

from typing import Literal

from tokenmill.server.protocol import (
    CallId,
    ChatCompletionRequest,
    FunctionDefinition,
    Priority,
    _Body,
    bad_request,
    parse_part,
    parse_tagged,
)

# chat field names -> the Responses API's, for the errors of the chat path (see `protocol.renamed`)
RENAMES = (
    (r"messages$", "input"),
    (r"max_completion_tokens$", "max_output_tokens"),
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"response_format\.json_schema\.schema", "text.format.schema"),
    (r"response_format", "text.format"),
    (r"chat_template_kwargs\.reasoning_effort", "reasoning.effort"),
)


class ResponseTextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict]  # text parts (`_text`)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: CallId
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | list[dict]  # text parts (`_text`)


class ReasoningItem(_Body):
    type: Literal["reasoning"]


_ITEMS = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(FunctionDefinition):
    """Chat's function definition, flat in the tool as the Responses API sends it."""

    type: Literal["function"]


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextConfig(_Body):
    format: dict | None = None


class ReasoningConfig(_Body):
    effort: Literal["minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    max_reasoning_tokens: int | None = None  # tokenmill: the thinking budget (with --reasoning-parser)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    background: bool = False
    priority: Priority = 0  # with --scheduling-policy priority (tokenmill, as vLLM's)
    metadata: dict[str, str] | None = None
    user: str | None = None

    def input_messages(self) -> list[dict]:
        """`input` as chat messages: consecutive function calls join the assistant message before them."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for i, raw in enumerate(self.input):
            path = f"input[{i}]"
            if not isinstance(raw, dict):
                raise bad_request(f"{path} must be an object (a message or an item)", path)
            item = parse_tagged(_ITEMS, raw.get("type", "message" if "role" in raw else None), raw, path)
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _text(item.content, f"{path}.content")})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"{path}.output")}
                )
        return out

    def chat_request(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request this is: the instructions, then `conversation` (the stored one of
        `previous_response_id`, then `input_messages()`)."""
        if self.background:
            raise bad_request("background responses are not supported", "background", "unsupported")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        if not messages:
            raise bad_request("input must hold at least one message", "input")
        body = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "max_reasoning_tokens": self.max_reasoning_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "tools": [_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "priority": self.priority,
        }
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        return ChatCompletionRequest.model_validate(body, strict=True)


def _text(content: str | list[dict], path: str) -> str:
    """A message's text: a string, or its text parts (images and files are refused)."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise bad_request(
                f"{path}[{j}].type must be 'input_text' or 'output_text' (this server reads text only), "
                f"got {str(kind)[:40]!r}",
                f"{path}[{j}].type",
                "unsupported",
            )
    return "".join(parse_part(ResponseTextPart, part, f"{path}[{j}]").text for j, part in enumerate(content))


def _chat_tool(raw, i: int) -> dict:
    path = f"tools[{i}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind != "function":
        raise bad_request(
            f"{path}.type must be 'function' (the only tools this server runs), got {str(kind)[:40]!r}",
            f"{path}.type",
            "unsupported",
        )
    tool = parse_part(FunctionTool, raw, path)
    return {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}


def _response_format(fmt: dict) -> dict:
    """`text.format` as chat's `response_format` (errors are renamed back by `RENAMES`)."""
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "output")}
        if "schema" in fmt:
            schema["schema"] = fmt["schema"]
        return {"type": "json_schema", "json_schema": schema}
    return fmt
