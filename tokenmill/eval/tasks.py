"""Task files and their metrics. One JSON object per line, of one of three kinds:

- loglikelihood:   {"context": "...", "continuation": "..."}
                   -> per item the summed logprob of the continuation's tokens and whether each of them
                   was the most likely one (is_greedy); mean loglikelihood.
- multiple_choice: {"context": "...", "choices": ["...", ...], "gold": index}
                   -> the choice with the highest loglikelihood (acc) and per character (acc_norm).
- perplexity:      {"text": "..."}
                   -> exp(-mean logprob) over every token after each text's first (word-level as well).

A scorer (`tokenmill.eval.scorers`) gives, for a text, its tokens' strings, character offsets,
logprobs (None for the first) and whether each token was the top-1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

KINDS = ("loglikelihood", "multiple_choice", "perplexity")


@dataclass
class Scored:
    """One scored text: per token its offset in the text, logprob (None for the first) and top-1 flag."""

    offsets: list[int]
    logprobs: list[float | None]
    greedy: list[bool]

    def continuation(self, start: int) -> tuple[float, bool, int]:
        """(summed logprob, all greedy, token count) of the tokens that start at or after char `start`."""
        picked = [i for i, o in enumerate(self.offsets) if o >= start and self.logprobs[i] is not None]
        if not picked:
            raise ValueError("the continuation has no tokens of its own (it merged into the context's last token)")
        return sum(self.logprobs[i] for i in picked), all(self.greedy[i] for i in picked), len(picked)


def load_task(path: str | Path, kind: str = "auto") -> tuple[str, list[dict]]:
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    if not items:
        raise ValueError(f"{path}: no items")
    if kind == "auto":
        first = items[0]
        kind = (
            "multiple_choice"
            if "choices" in first
            else "loglikelihood"
            if "continuation" in first
            else "perplexity"
            if "text" in first
            else None
        )
        if kind is None:
            raise ValueError(f"{path}: cannot tell the task kind from the first item's fields {sorted(first)}")
    if kind not in KINDS:
        raise ValueError(f"task kind must be one of {', '.join(KINDS)}, got {kind!r}")
    need = {
        "loglikelihood": ("context", "continuation"),
        "multiple_choice": ("context", "choices", "gold"),
        "perplexity": ("text",),
    }[kind]
    for n, item in enumerate(items, 1):
        missing = [k for k in need if k not in item]
        if missing:
            raise ValueError(f"{path}: item {n} has no {', '.join(missing)} (a {kind} task)")
    return kind, items


CORPUS = Path(__file__).with_name("corpus.txt")  # shipped: `tokenmill eval perplexity` needs no download


def corpus_items(path: str | Path | None = None, chunk_chars: int = 2000) -> list[dict]:
    """A text file as perplexity items: consecutive chunks of whole lines, each about `chunk_chars`
    characters (a line longer than that is a chunk of its own); the shipped corpus by default."""
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    text = Path(path or CORPUS).read_text()
    items, chunk = [], ""
    for line in text.splitlines(keepends=True):
        if chunk and len(chunk) + len(line) > chunk_chars:
            items.append({"text": chunk})
            chunk = ""
        chunk += line
    if chunk.strip():
        items.append({"text": chunk})
    if not items:
        raise ValueError(f"{path}: no text")
    return items


def texts_to_score(kind: str, items: list[dict]) -> list[tuple[str, int]]:
    """(text, where the scored part starts) for every text the task needs scored."""
    if kind == "perplexity":
        return [(item["text"], 0) for item in items]
    if kind == "loglikelihood":
        return [(item["context"] + item["continuation"], len(item["context"])) for item in items]
    return [(item["context"] + choice, len(item["context"])) for item in items for choice in item["choices"]]


def evaluate(kind: str, items: list[dict], scored: list[Scored]) -> dict:
    """The task's metrics and per-item results, from the scored texts in `texts_to_score` order."""
    pieces = iter(zip(texts_to_score(kind, items), scored))
    per_item = []
    if kind == "perplexity":
        total, tokens, words = 0.0, 0, 0
        for (text, _), s in pieces:
            lps = [lp for lp in s.logprobs if lp is not None]
            total, tokens, words = total + sum(lps), tokens + len(lps), words + len(text.split())
            per_item.append({"loglikelihood": sum(lps), "tokens": len(lps)})
        return {
            "kind": kind,
            "items": len(items),
            "token_perplexity": math.exp(-total / max(tokens, 1)),
            "word_perplexity": math.exp(-total / max(words, 1)),
            "per_item": per_item,
        }
    if kind == "loglikelihood":
        for (_, start), s in pieces:
            ll, greedy, n = s.continuation(start)
            per_item.append({"loglikelihood": ll, "is_greedy": greedy, "tokens": n})
        return {
            "kind": kind,
            "items": len(items),
            "mean_loglikelihood": sum(p["loglikelihood"] for p in per_item) / len(per_item),
            "greedy_fraction": sum(p["is_greedy"] for p in per_item) / len(per_item),
            "per_item": per_item,
        }
    correct = correct_norm = 0
    for item in items:
        lls = [s.continuation(start)[0] for (_, start), s in (next(pieces) for _ in item["choices"])]
        norm = [ll / max(len(c), 1) for ll, c in zip(lls, item["choices"])]
        pick, pick_norm = lls.index(max(lls)), norm.index(max(norm))
        correct += pick == item["gold"]
        correct_norm += pick_norm == item["gold"]
        per_item.append({"loglikelihoods": lls, "pick": pick, "pick_norm": pick_norm, "gold": item["gold"]})
    return {
        "kind": kind,
        "items": len(items),
        "acc": correct / len(items),
        "acc_norm": correct_norm / len(items),
        "per_item": per_item,
    }
