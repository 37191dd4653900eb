"""Serving metrics as pure functions of per-request records.

Definitions (times in seconds in records, milliseconds in summaries):
  TTFT  time from sending the request to the first non-empty content chunk
  ITL   gaps between consecutive content chunks (pooled over all requests)
  TPOT  per request, (e2e - ttft) / (output_tokens - 1)
  E2EL  time from sending the request to the end of its stream
  achieved concurrency  sum of request latencies / run duration (Little's law)
  goodput  successful requests per second that meet every SLO threshold
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el", "e2el": "e2el"}
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass
class RequestRecord:
    """What happened to one request. Failed requests keep their partial timings and the error text."""

    session: int = 0
    turn: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds after the run started
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" (server-reported), "tokenizer" or "chunks"
    num_chunks: int = 0  # non-empty content chunks streamed
    expected_prompt_len: int | None = None
    expected_output_len: int | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when reported
    output_text: str = field(default="", repr=False)  # kept in memory (multi-turn), not written to JSON

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_tokens) if self.success else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("output_text")
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def tpot(e2e: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first; None with fewer than two tokens."""
    if e2e is None or ttft is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def itl_from_times(times: list[float]) -> list[float]:
    """Gaps between consecutive timestamps."""
    return [b - a for a, b in zip(times, times[1:])]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: list[float], scale: float = 1.0) -> dict:
    """mean, median, std (population), min, max and P50/P90/P95/P99 of `values` times `scale`;
    count 0 and None statistics for an empty sample."""
    xs = [v * scale for v in values if v is not None]
    stats: dict = {"count": len(xs)}
    if not xs:
        return stats | {k: None for k in ("mean", "median", "std", "min", "max")} | {f"p{p}": None for p in PERCENTILES}
    mean = sum(xs) / len(xs)
    stats |= {
        "mean": mean,
        "median": percentile(xs, 50),
        "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)),
        "min": min(xs),
        "max": max(xs),
    }
    stats |= {f"p{p}": percentile(xs, p) for p in PERCENTILES}
    return stats


def parse_slo(text: str | None) -> dict[str, float]:
    """ "ttft=500ms,tpot=50ms,e2e=10s" -> {"ttft": 0.5, "tpot": 0.05, "e2el": 10.0} (seconds).
    Units us, ms or s; a bare number is milliseconds."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO term {part.strip()!r}: expected KEY=VALUE with KEY in ttft, tpot, e2e")
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(us|ms|s)?\s*", value, re.IGNORECASE)
        if not m:
            raise ValueError(f"bad SLO value {value.strip()!r} for {key}: expected a number with unit us, ms or s")
        slo[SLO_KEYS[key]] = float(m.group(1)) * _UNITS[(m.group(2) or "ms").lower()]
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request whose TTFT, TPOT and E2E latency are within `slo` (TPOT is not checked for
    requests with a single output token)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2e}
    for key, limit in slo.items():
        value = values[key]
        if value is None:
            if key == "tpot":
                continue
            return False
        if value > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None) -> dict:
    """Every aggregate metric of a run from its records and duration (seconds)."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "achieved_concurrency": per_s(sum(r.e2e for r in records if r.e2e is not None)),
        "ttft_ms": distribution([r.ttft for r in ok], 1000),
        "tpot_ms": distribution([r.tpot for r in ok], 1000),
        "itl_ms": distribution([gap for r in ok for gap in r.itl], 1000),
        "e2el_ms": distribution([r.e2e for r in ok], 1000),
        "client_cached_tokens": sum(cached) if cached else None,
        "slo": {k: v * 1000 for k, v in (slo or {}).items()},
        "goodput": None,
        "slo_attainment": None,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(records) if records else None
    return summary


def cost_metrics(cost_per_hour: float | None, summary: dict) -> dict | None:
    """$ for the run at `cost_per_hour`, per 1M input tokens, per 1M output tokens and per request.
    Each per-unit figure charges the whole machine time to that unit alone (as a price list would)."""
    if not cost_per_hour:
        return None
    total = cost_per_hour * summary["duration_s"] / 3600

    def per(n: float, unit: float = 1.0) -> float | None:
        return total / n * unit if n else None

    return {
        "cost_per_hour": cost_per_hour,
        "run_cost": total,
        "per_1m_input_tokens": per(summary["total_input_tokens"], 1e6),
        "per_1m_output_tokens": per(summary["total_output_tokens"], 1e6),
        "per_request": per(summary["completed"]),
    }


def find_knee(points: list[dict], min_attainment: float) -> dict | None:
    """The point with the highest `load` whose `slo_attainment` is at least `min_attainment`.
    `points` are dicts with "load" and "summary"; None if none meets the SLO (or no SLO was set)."""
    meeting = [
        p
        for p in points
        if (p["summary"].get("slo_attainment") or 0) >= min_attainment
        and p["summary"].get("slo_attainment") is not None
    ]
    return max(meeting, key=lambda p: p["load"], default=None)


def expert_load_summary(expert_tokens: list[list[float]], rank_tokens: list[float] = ()) -> dict | None:
    """Mixture-of-experts routing over a run, from tokens routed to each expert per MoE layer: each
    layer's load imbalance (max / mean over its experts; 1.0 is perfectly even), the worst and the
    mean over layers; with expert parallelism (`rank_tokens`: tokens routed to each rank's experts)
    those and the ranks' imbalance. None without MoE layers or routed tokens."""
    per_layer = [max(c) / (sum(c) / len(c)) for c in expert_tokens if c and sum(c) > 0]
    if not per_layer:
        return None
    summary = {
        "moe_layers": len(expert_tokens),
        "routed_tokens": sum(sum(c) for c in expert_tokens),
        "load_imbalance_max": max(per_layer),
        "load_imbalance_mean": sum(per_layer) / len(per_layer),
        "load_imbalance_per_layer": per_layer,
    }
    if rank_tokens and sum(rank_tokens) > 0:
        summary.update(
            rank_tokens=list(rank_tokens), rank_imbalance=max(rank_tokens) / (sum(rank_tokens) / len(rank_tokens))
        )
    return summary
