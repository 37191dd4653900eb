"""The token budget of a step, bounded in time (`--max-step-ms`).

A step runs to its end: an abort, a new request's first token and every running request's next
token wait for it. On a CPU a full chunk of a long prompt (`--max-num-batched-tokens`) can take
seconds, more on a busy machine, so the budget is lowered to what the measured time per token fits in
`max_step_ms`. The time per token is taken from steps that prefill (a chunk of at least
`MIN_TOKENS` tokens of one request: the steps the bound is for), as a moving average, so it follows
the machine getting busier or quieter. It never rises above `max_num_batched_tokens`, which alone
decides where steps are fast enough.
"""

from __future__ import annotations

MIN_TOKENS = 32  # the budget's floor (every step makes progress) and the chunk size that is measured
_WEIGHT = 0.3  # of the latest step in the moving average


class StepBudget:
    def __init__(self, max_step_ms: float, max_tokens: int) -> None:
        self.max_seconds = max_step_ms / 1000
        self.max_tokens = max_tokens
        self.seconds_per_token: float | None = None  # none measured yet

    def observe(self, num_scheduled_tokens: dict[str, int], seconds: float) -> None:
        """A step that ran for `seconds` with these tokens per request."""
        if not self.max_seconds or not num_scheduled_tokens or max(num_scheduled_tokens.values()) < MIN_TOKENS:
            return
        per_token = seconds / sum(num_scheduled_tokens.values())
        last = self.seconds_per_token
        self.seconds_per_token = per_token if last is None else (1 - _WEIGHT) * last + _WEIGHT * per_token

    @property
    def tokens(self) -> int:
        """The budget of the next step."""
        if not self.max_seconds or self.seconds_per_token is None:
            return self.max_tokens
        return max(MIN_TOKENS, min(self.max_tokens, int(self.max_seconds / self.seconds_per_token)))
