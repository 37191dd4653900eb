"""n-gram (prompt lookup) drafter: find an earlier occurrence of the sequence's last n tokens (n
from `max_n` down to `min_n`; the latest one with k tokens after it) and draft the tokens that
followed it. Costs no model call; runs in the model runner on the request's tokens after the step;
pays off where the output repeats its context (code editing, quoting, extraction)."""

from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.drafter import Drafter, DraftStep


class NgramDrafter(Drafter):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        drafts = {}
        for rid, k in step.wanted.items():
            s = step.requests[rid]
            left = (s.params.max_tokens or 1 << 30) - len(s.output_token_ids) - 1  # tokens it may still draft
            drafts[rid] = self.lookup(s.prompt_token_ids + s.output_token_ids, min(k, left))
        return drafts

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` drafted tokens to follow `tokens` (empty when no n-gram recurs)."""
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-n:]
            # windows[i] = seq[i : i + n] for every start i whose match leaves at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:  # the latest match that has k tokens after it, else the earliest (the most after it)
                full = hits[hits + n + k <= len(seq)]
                start = int(full[-1] if full.size else hits[0]) + n
                return seq[start : start + k].tolist()
        return []
