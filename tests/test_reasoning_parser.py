"""The <think> reasoning parser on synthetic text: whole outputs, and the same outputs streamed in every
way of cutting them (deltas must add up to exactly the whole-text split)."""

from __future__ import annotations

import random

import pytest

from tokenmill.structured.reasoning import REASONING_PARSERS, ThinkReasoningParser, prompt_closes_reasoning

CASES = [
    # (output, in_reasoning, reasoning_content, content)
    ("<think>Let me think.</think>The answer is 4.", True, "Let me think.", "The answer is 4."),
    ("<think>\nstep 1\nstep 2\n</think>\n\n42", True, "\nstep 1\nstep 2\n", "\n\n42"),
    ("  <think>a</think>b", True, "a", "b"),  # whitespace before the opening tag
    ("no opening tag</think>answer", True, "no opening tag", "answer"),  # DeepSeek-R1: <think> is in the prompt
    ("<think>cut off by max_tokens", True, "cut off by max_tokens", None),
    ("<think>", True, None, None),
    ("plain text, never thinks", True, "plain text, never thinks", None),
    ("</think>", True, None, None),
    ('<think></think>{"a": 1}', True, None, '{"a": 1}'),
    ("<think>x < y and a </ b</think>ok</think>", True, "x < y and a </ b", "ok</think>"),  # only the first ends it
    ("<thin", True, "<thin", None),  # an unfinished tag at the very end is text
    ("<think>a</thi", True, "a", None),  # cut inside the closing tag: its start is not reasoning
    ("<think>a <", True, "a ", None),
    ("<think>a </b", True, "a </b", None),
    ("<think>all content</think>", False, None, "<think>all content</think>"),  # the prompt closed it
    ("", True, None, None),
]


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_whole_text(text, in_reasoning, reasoning, content):
    assert ThinkReasoningParser.parse(text, in_reasoning) == (reasoning, content)


def _stream(text: str, cuts: list[int], in_reasoning: bool) -> tuple[str | None, str | None]:
    parser = ThinkReasoningParser(in_reasoning)
    r, c = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        dr, dc = parser.feed(text[a:b])
        r.append(dr)
        c.append(dc)
    dr, dc = parser.finish()
    return "".join(r + [dr]) or None, "".join(c + [dc]) or None


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_streamed_in_every_split(text, in_reasoning, reasoning, content):
    for size in (1, 2, 3, 5):  # fixed-size deltas
        assert _stream(text, list(range(size, len(text), size)), in_reasoning) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(30):  # random deltas
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
        assert _stream(text, cuts, in_reasoning) == (reasoning, content)


def test_stream_never_leaks_a_tag():
    parser = ThinkReasoningParser()
    out = [parser.feed(d) for d in ["<", "thi", "nk>", "hmm", " </", "thin", "k>", "yes"]]
    assert out == [("", ""), ("", ""), ("", ""), ("hmm", ""), (" ", ""), ("", ""), ("", ""), ("", "yes")]
    assert parser.finish() == ("", "")
    assert not parser.in_reasoning


def test_prompt_closes_reasoning():
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_closes_reasoning("<|Assistant|><think>\n")  # DeepSeek-R1: the model thinks next
    assert not prompt_closes_reasoning("<|im_start|>assistant\n")  # Qwen3, thinking on
    assert not prompt_closes_reasoning("<think>old</think> ... <think>\n")


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
