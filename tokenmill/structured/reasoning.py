"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content`.

Models in the DeepSeek-R1 / Qwen3 family think inside `<think> ... </think>` and answer after it. The
parser works on streamed text deltas (`feed`, then `finish`); `parse` on a whole text gives exactly what
the stream gives, by construction.

Rules (both `deepseek_r1` and `qwen3`):
* if the prompt already closed the thinking (the last `<think>` in the prompt is followed by
  `</think>`, as Qwen3's template writes with thinking disabled), everything is content;
* otherwise the output starts in reasoning: an opening `<think>` (after optional whitespace) is dropped,
  text up to the first `</think>` is reasoning, and the text after it is content;
* output that never closes its thinking is all reasoning (e.g. cut by max_tokens), less a closing tag
  it stopped inside (`...</thi`: cut while the model, or a thinking budget, wrote `</think>`; a tag that is
  one token, as Qwen3's, is never cut so).
Text that might be the start of a tag is held back until the next delta tells.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_closes_reasoning(prompt_text: str, start: str = START, end: str = END) -> bool:
    """True if the prompt ends the thinking itself (then the output is all content)."""
    i = prompt_text.rfind(start)
    return i >= 0 and prompt_text.find(end, i) >= 0


class ThinkReasoningParser:
    """Incremental `<think>` splitter for one output."""

    start = START
    end = END

    def __init__(self, in_reasoning: bool = True) -> None:
        self._state = "start" if in_reasoning else "content"
        self._pending = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state != "content"

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; returns (reasoning delta, content delta) safe to emit now."""
        if self._state == "content":
            return "", text
        self._pending += text
        reasoning = ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(self.start):
                self._pending = stripped[len(self.start) :]
                self._state = "reasoning"
            elif self.start.startswith(stripped):
                return "", ""  # may still become the opening tag
            else:
                self._state = "reasoning"
        i = self._pending.find(self.end)
        if i >= 0:
            reasoning, content = self._pending[:i], self._pending[i + len(self.end) :]
            self._pending, self._state = "", "content"
            return reasoning, content
        hold = _partial_suffix(self._pending, self.end)
        cut = len(self._pending) - hold
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The output ended: flush what was held back (an unfinished thought is reasoning; the start of a
        closing tag it ended in is not)."""
        if self._state == "content":
            return "", ""
        rest, self._pending = self._pending, ""
        if self._state == "start":
            rest = rest.lstrip()
            if rest.startswith(self.start):
                rest = rest[len(self.start) :]
            return rest, ""
        return rest[: len(rest) - _partial_suffix(rest, self.end)], ""

    @classmethod
    def parse(cls, text: str, in_reasoning: bool = True) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        parser = cls(in_reasoning)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, (c1 + c2) or None


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
}
