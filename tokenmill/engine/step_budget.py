"""The token budget of a step, bounded in time (`--max-step-ms`).

A step runs to its end: an abort, a new request's first token and every running request's next
token wait for it. On a CPU a full chunk of a long prompt (`--max-num-batched-tokens`) can take
seconds, more on a busy machine, so the budget is lowered to what fits in `max_step_ms`.

A step's time is fitted as `fixed + per_token * tokens` over the recent steps (moving averages of
tokens, seconds and their products, so the fit follows the machine getting busier or quieter): the
fixed part is the pass over the weights every step pays, whatever its size. The budget is what
fits in the bound after the fixed part — but never so small that the fixed part outweighs the
tokens' own time (chunks that small would multiply the prefill's cost for little gain), never under
`MIN_TOKENS`, and never above `max_num_batched_tokens`, which alone decides where steps are fast enough.
"""

from __future__ import annotations

MIN_TOKENS = 32  # the budget's floor: every step makes progress
_WEIGHT = 0.2  # of the latest step in the moving averages


class StepBudget:
    def __init__(self, max_step_ms: float, max_tokens: int) -> None:
        self.max_seconds = max_step_ms / 1000
        self.max_tokens = max_tokens
        self._moments: tuple[float, float, float, float] | None = None  # E[n], E[t], E[n*n], E[n*t]

    def observe(self, num_scheduled_tokens: dict[str, int], seconds: float) -> None:
        """A step that ran for `seconds` with these tokens per request."""
        n = sum(num_scheduled_tokens.values())
        if not self.max_seconds or not n:
            return
        sample = (n, seconds, n * n, n * seconds)
        m = self._moments
        self._moments = sample if m is None else tuple((1 - _WEIGHT) * a + _WEIGHT * b for a, b in zip(m, sample))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a step, or None before any step."""
        if self._moments is None:
            return None
        n, t, nn, nt = self._moments
        variance = nn - n * n
        per_token = (nt - n * t) / variance if variance > 1e-6 * nn else 0.0
        if per_token <= 0:  # steps of one size so far (or noise): all of it counted per token
            return 0.0, t / n
        return max(t - per_token * n, 0.0), per_token

    @property
    def tokens(self) -> int:
        """The budget of the next step."""
        fit = self.fit() if self.max_seconds else None
        if fit is None:
            return self.max_tokens
        fixed, per_token = fit
        fitting = (self.max_seconds - fixed) / per_token
        return int(min(self.max_tokens, max(MIN_TOKENS, fitting, fixed / per_token)))
