"""The text a request is routed on: what the replica's prefix cache will see first.

Completions route on `prompt` (a string; a batch of strings joined; token ids written out as
numbers), chat on a stable rendering of the messages (role, text and tool calls of each, in order),
Responses on its instructions and input items and Anthropic's Messages on its system prompt and
messages, rendered the same way; embeddings and token counts keep no KV cache and route by load. The
rendering need not be the model's chat template: it only has to put equal conversation prefixes
at equal text prefixes, the same way for every replica.
"""

from __future__ import annotations

import json

_SEPARATOR = "\x1e"  # between prompts of a batch and between messages: never inside a chunk of real text


def routing_text(path: str, request: dict) -> str | None:
    """The routing text of a request (its parsed body) to `path`, or None when it has none."""
    if path.endswith("/chat/completions"):
        return _chat_text(request.get("messages"))
    if path.endswith("/responses"):
        items = request.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        return _chat_text(_with_system(request.get("instructions"), items))
    if path.endswith("/messages"):
        return _chat_text(_with_system(request.get("system"), request.get("messages")))
    if path.endswith("/completions"):
        return _prompt_text(request.get("prompt"))
    return None


def _with_system(system, messages):
    """`messages` after a system message of `system`, when there is one and they are a list."""
    if system is None or not isinstance(messages, list):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _prompt_text(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _SEPARATOR.join(prompt)
        if all(isinstance(t, int) for t in prompt):
            return _token_text(prompt)
        if all(isinstance(p, list) for p in prompt):
            return _SEPARATOR.join(_token_text(p) for p in prompt)
    return None


def _token_text(ids: list) -> str:
    return " ".join(str(t) for t in ids) + " "


def _chat_text(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        text = f"{m.get('role', '')}:{_content_text(m.get('content'))}"
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], sort_keys=True)
        parts.append(text)
    return _SEPARATOR.join(parts) + _SEPARATOR


def _content_text(content) -> str:
    """A message's text: the string, or its text parts in order (other parts as their JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else json.dumps(p, sort_keys=True)
            for p in content
        )
    return json.dumps(content, sort_keys=True)
