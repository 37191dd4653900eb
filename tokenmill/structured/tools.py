"""Tool calling: prompts, constraints and output parsers (OpenAI `tools` / `tool_choice`).

Prompt. If the model's chat template handles `tools` itself, tools and tool messages go to the
template unchanged. Otherwise tokenmill's default format is used (Hermes / Qwen style): a system-prompt
section lists the functions as JSON inside `<tools>...</tools>` and asks for calls as

    <tool_call>
    {"name": "<function name>", "arguments": {...}}
    </tool_call>

earlier assistant calls are written back in that form, and `role: tool` results become user turns
wrapped in `<tool_response>...</tool_response>`.

Output, by `tool_choice`:
* `auto`: free text; `<tool_call>` blocks are parsed out of it (`HermesToolParser`).
* `required`: constrained to the JSON schema `required_schema(tools)`: an array of
  `{"name": <one of the tools>, "arguments": <that tool's parameters>}` (one item only without
  parallel tool calls), parsed by `ArrayToolParser`.
* a named function: constrained to that function's parameters schema; the whole output is the
  arguments (`NamedToolParser`).

Every parser takes text deltas (`feed`) and ends with `finish()`, returning events
`("content", text)`, `("call", index, name)` (a call starts) and `("args", index, text)` (more argument
text). `collect(parser, text)` runs a whole text through one: the stream and the full response are the
same by construction.
"""

from __future__ import annotations

import json
import re

CALL_START, CALL_END = "<tool_call>", "</tool_call>"

Event = tuple


def tool_function(tool: dict) -> dict:
    """{"name", "description", "parameters"} of an OpenAI tool definition."""
    return tool["function"] if "function" in tool else tool


def parameters_schema(tool: dict) -> dict:
    params = tool_function(tool).get("parameters")
    return params if params else {"type": "object", "properties": {}}


def template_supports_tools(template: str | None) -> bool:
    """A chat template that references `tools` renders them itself."""
    return isinstance(template, str) and "tools" in template


# ---- prompt -------------------------------------------------------------------------------------


def default_tools_prompt(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": tool_function(t)}, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. The functions, "
        f"described as JSON:\n<tools>\n{lines}\n</tools>\n\nTo call functions, reply with one block per call, "
        f'each in this form:\n{CALL_START}\n{{"name": "<function name>", "arguments": <arguments as a JSON '
        f"object>}}\n{CALL_END}"
    )


def _call_block(name: str, arguments) -> str:
    return f"{CALL_START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_END}"


def _arguments_value(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """Messages for the chat template. `messages` are OpenAI-shaped dicts (role, content, and
    tool_calls / tool_call_id where present). With `native` the template gets tool calls and tool
    results as they are (arguments as objects); otherwise they are written in the default format and
    the tool list goes into the system prompt."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if native:
            msg = {"role": role, "content": content}
            if calls:
                msg["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments_value(c["function"]["arguments"]),
                        },
                    }
                    for c in calls
                ]
            if role == "tool":
                msg["tool_call_id"] = m.get("tool_call_id")
            out.append(msg)
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif calls:
            blocks = [_call_block(c["function"]["name"], _arguments_value(c["function"]["arguments"])) for c in calls]
            out.append({"role": role, "content": "\n".join(([content] if content else []) + blocks)})
        else:
            out.append({"role": role, "content": content})
    if tools and not native:
        prompt = default_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- constraints --------------------------------------------------------------------------------


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """JSON schema of `tool_choice: "required"` output: a non-empty array of calls."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool_function(t)["name"]]},
                "arguments": parameters_schema(t),
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- parsers ------------------------------------------------------------------------------------


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser:
    """`tool_choice: auto`: content with `<tool_call>{"name", "arguments"}</tool_call>` blocks. A block
    that is not a valid call stays content."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                i = self._buf.find(CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, CALL_START)
                    self._content(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._content(events, self._buf[:i])
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(CALL_END)
            if j < 0:
                return events
            block = self._buf[: j + len(CALL_END)]
            self._buf = self._buf[j + len(CALL_END) :]
            self._in_call = False
            self._block(events, block, block[len(CALL_START) : j])

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._in_call:  # an unclosed block: a call if its JSON is complete
            self._block(events, rest, rest[len(CALL_START) :])
        else:
            self._content(events, rest)
        return events

    def _content(self, events: list[Event], text: str) -> None:
        if text:
            events.append(("content", text))

    def _block(self, events: list[Event], raw: str, body: str) -> None:
        call = _parse_call(body)
        if call is None or (self.num_calls and not self.parallel):
            self._content(events, raw if call is None else "")
            return
        name, arguments = call
        events.append(("call", self.num_calls, name))
        events.append(("args", self.num_calls, arguments))
        self.num_calls += 1


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return obj["name"], arguments
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class NamedToolParser:
    """A named `tool_choice`: the whole output is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.num_calls == 0:
            events.append(("call", 0, self.name))
            self.num_calls = 1
        if text:
            events.append(("args", 0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("") if self.num_calls == 0 else []


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WS = " \t\r\n"


class ArrayToolParser:
    """`tool_choice: required`: a JSON array of {"name", "arguments"} (the grammar fixes the key order),
    streamed: a call starts when its name is known, its arguments stream as the model writes them."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._buf = ""
        self._pos = 0  # scanned up to here
        self._state = "open"  # open -> item -> args -> item_end -> item ... -> done
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._args_started = False
        self._text_out = ""  # for finish(): the raw text when it was not an array of calls

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _skip_ws(self) -> bool:
        while self._pos < len(self._buf) and self._buf[self._pos] in _WS:
            self._pos += 1
        return self._pos < len(self._buf)

    def _step(self, events: list[Event]) -> bool:
        """Advance the scan; False when more text is needed (or the array ended)."""
        b = self._buf
        if self._state == "open":
            if not self._skip_ws():
                return False
            if b[self._pos] != "[":
                self._state = "invalid"
                return False
            self._pos += 1
            self._state = "item"
            return True
        if self._state == "item":
            if not self._skip_ws():
                return False
            c = b[self._pos]
            if c == "]":
                self._pos += 1
                self._state = "done"
                return False
            if c == ",":
                self._pos += 1
                return True
            m = _HEAD.match(b, self._pos)
            if m is None or m.end() == len(b):  # header incomplete (or the value has not started)
                return False
            name = json.loads(f'"{m.group(1)}"')
            events.append(("call", self.num_calls, name))
            self._pos = m.end()
            self._state, self._depth, self._in_string, self._args_started = "args", 0, False, False
            return True
        if self._state == "args":
            start = self._pos
            done = self._scan_value()
            if self._pos > start:
                events.append(("args", self.num_calls, b[start : self._pos]))
            if done:
                self.num_calls += 1
                self._state = "item_end"
                return True
            return False
        if self._state == "item_end":
            if not self._skip_ws():
                return False
            if b[self._pos] == "}":
                self._pos += 1
                self._state = "item"
                return True
            self._state = "invalid"
        return False

    def _scan_value(self) -> bool:
        """Move over the arguments value; True once it is complete."""
        b = self._buf
        while self._pos < len(b):
            c = b[self._pos]
            if self._in_string:
                self._pos += 1
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return True
                continue
            if c == '"':
                self._in_string, self._args_started = True, True
            elif c in "{[":
                self._depth += 1
                self._args_started = True
            elif c in "}]":
                if self._depth == 0:  # the end of the enclosing item: a scalar value just ended
                    return True
                self._depth -= 1
                self._pos += 1
                return_now = self._depth == 0
                if return_now:
                    return True
                continue
            elif c in ",":
                if self._depth == 0 and self._args_started:
                    return True
            elif c not in _WS:
                self._args_started = True
            self._pos += 1
        return False

    def finish(self) -> list[Event]:
        if self.num_calls == 0 and self._state != "args":
            text = self._buf
            self._buf, self._pos = "", 0
            return [("content", text)] if text else []
        return []


def collect(parser, text: str) -> tuple[str, list[dict]]:
    """Run a whole output through a parser: (content, [{"name", "arguments"}, ...])."""
    content: list[str] = []
    calls: list[dict] = []
    for event in parser.feed(text) + parser.finish():
        apply_event(event, content, calls)
    return "".join(content), calls


def apply_event(event: Event, content: list[str], calls: list[dict]) -> None:
    if event[0] == "content":
        content.append(event[1])
    elif event[0] == "call":
        calls.append({"name": event[2], "arguments": ""})
    else:
        calls[event[1]]["arguments"] += event[2]
