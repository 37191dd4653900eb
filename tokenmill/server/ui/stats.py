"""`/ui/stats`: the web page's dashboard numbers, computed from the server's own Prometheus registry.

The page could scrape `/metrics` and parse the text format in JavaScript; instead the server reads its
registry here and answers one JSON object of ready numbers, so the page stays a few small files and
the definitions (percentiles from histogram buckets, rates, cost) live in tested Python.

Every windowed figure compares the registry now with a snapshot taken about `window` seconds earlier:
the answers' snapshots are kept (at most one every `_MIN_GAP` s, for `MAX_WINDOW` s), plus one taken
when the server starts, so the first answer covers everything since the start and the window then
grows to its length. Several
open pages share the same snapshots; none of them changes what another sees.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass

import psutil
from prometheus_client import CollectorRegistry

from tokenmill.http_front import bad_request

MAX_WINDOW = 300.0  # seconds of snapshots kept: the longest window a page may ask for
_MIN_GAP = 1.0  # seconds between kept snapshots: at most MAX_WINDOW / _MIN_GAP of them
_PREFIX = "tokenmill:"
_LATENCIES = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "tpot": "time_per_output_token_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue": "request_queue_time_seconds",
}

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name without the prefix, its labels but model_name


def window_param(raw: str | None) -> float:
    """`/ui/stats?window=SECONDS` (default 10), or a 400 naming it."""
    try:
        window = 10.0 if raw is None else float(raw)
    except ValueError:
        window = math.nan
    if not 0 < window <= MAX_WINDOW:
        raise bad_request(f"window must be a number of seconds in (0, {MAX_WINDOW:g}], got {raw!r}", "window")
    return window


@dataclass
class Snapshot:
    time: float  # time.monotonic()
    samples: dict[Key, float]
    cpu_seconds: float  # user + system time of the server's process and its children (engine core, workers)


def take_snapshot(registry: CollectorRegistry, process: psutil.Process) -> Snapshot:
    samples: dict[Key, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_created") or "expert" in s.labels:  # per-expert counts: the page shows imbalance
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name.removeprefix(_PREFIX), labels)] = s.value
    return Snapshot(time.monotonic(), samples, _cpu_seconds(process))


def _cpu_seconds(process: psutil.Process) -> float:
    total = 0.0
    for p in (process, *process.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.Error:  # a child that just exited
            continue
        total += t.user + t.system
    return total


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as cumulative (upper bound, count) pairs in increasing bound
    order, +inf last, interpolated linearly within the bucket it falls in (Prometheus's
    histogram_quantile); None without observations. In the +inf bucket it is the last finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class UIStats:
    """The dashboard's numbers for one server: `stats(window)` is the JSON `/ui/stats` answers."""

    def __init__(self, registry: CollectorRegistry, model_name: str, price_per_hour: float | None = None) -> None:
        self.registry, self.model_name, self.price_per_hour = registry, model_name, price_per_hour
        self.process = psutil.Process(os.getpid())
        self.cores = len(self.process.cpu_affinity()) if hasattr(self.process, "cpu_affinity") else os.cpu_count() or 1
        self.started = time.monotonic()
        self.snapshots: deque[Snapshot] = deque([take_snapshot(registry, self.process)])

    def _now(self) -> Snapshot:
        """The registry now; kept for later windows unless the last kept one is under `_MIN_GAP` s old."""
        now = take_snapshot(self.registry, self.process)
        if now.time - self.snapshots[-1].time >= _MIN_GAP:
            self.snapshots.append(now)
            while len(self.snapshots) > 2 and self.snapshots[1].time <= now.time - MAX_WINDOW:
                self.snapshots.popleft()  # the oldest kept one is the last at or before the cutoff
        return now

    def _base(self, now: Snapshot, window: float) -> Snapshot:
        """The kept snapshot before `now` nearest to `window` s before it (a page opened long after the
        start gets short windows that grow to `window`, not one average since the start)."""
        earlier = [s for s in self.snapshots if s.time < now.time] or [self.snapshots[0]]
        return min(earlier, key=lambda s: abs(now.time - window - s.time))

    def stats(self, window: float = 10.0) -> dict:
        now = self._now()
        then = self._base(now, window)
        d = _Delta(now, then)
        span = now.time - then.time
        rate = (lambda x: x / span) if span > 0 else (lambda x: None)
        prompt, generated = d.delta("prompt_tokens_total"), d.delta("generation_tokens_total")
        drafted, accepted = (
            d.delta("spec_decode_num_draft_tokens_total"),
            d.delta("spec_decode_num_accepted_tokens_total"),
        )
        busy = rate(max(now.cpu_seconds - then.cpu_seconds, 0.0))
        return {
            "model": self.model_name,
            "window_s": span,
            "uptime_s": now.time - self.started,
            "latency": {name: d.percentiles(metric) for name, metric in _LATENCIES.items()},
            "throughput": {
                "input_tok_s": rate(prompt),
                "output_tok_s": rate(generated),
                "requests_s": rate(d.delta_sum("request_success_total")),
            },
            "requests": {"running": d.value("num_requests_running"), "waiting": d.value("num_requests_waiting")},
            "kv_cache": {
                "usage": d.value("kv_cache_usage_perc"),
                "blocks": d.value("num_kv_blocks"),
                "free_blocks": d.value("num_free_kv_blocks"),
            },
            "prefix_cache": {
                "hit_rate": _ratio(d.delta("prefix_cache_hits_total"), d.delta("prefix_cache_queries_total")),
                "hit_rate_total": _ratio(d.value("prefix_cache_hits_total"), d.value("prefix_cache_queries_total")),
                "tiers": d.tiers(rate),
            },
            "preemptions": {"window": d.delta("num_preemptions_total"), "total": d.value("num_preemptions_total")},
            "spec_decode": {
                "acceptance": _ratio(accepted, drafted),
                "acceptance_total": _ratio(
                    d.value("spec_decode_num_accepted_tokens_total"), d.value("spec_decode_num_draft_tokens_total")
                ),
                "drafted_tokens_total": d.value("spec_decode_num_draft_tokens_total"),
            },
            "moe": _moe(d.by_label("moe_load_imbalance", "layer")),
            "engine_steps": _engine_steps(d, rate),
            "cpu": {
                "cores": self.cores,
                "cores_busy": busy,
                "utilization": None if busy is None else busy / self.cores,
            },
            "cost": self._cost(span, prompt, generated),
            "totals": {
                "prompt_tokens": d.value("prompt_tokens_total"),
                "generation_tokens": d.value("generation_tokens_total"),
                "requests": d.by_label("request_success_total", "finished_reason"),
            },
        }

    def _cost(self, span: float, prompt: float, generated: float) -> dict | None:
        """Dollars per million input / output tokens over the window: what the machine cost in the window
        over the tokens of each kind it processed. Each charges the whole machine to that one kind (the
        way a price sheet quotes both), so the two are not parts of one bill; idle time counts."""
        if self.price_per_hour is None:
            return None
        spent = self.price_per_hour * span / 3600
        return {
            "price_per_hour": self.price_per_hour,
            "per_million_input": spent * 1e6 / prompt if prompt else None,
            "per_million_output": spent * 1e6 / generated if generated else None,
        }


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _engine_steps(d: _Delta, rate) -> dict[str, dict]:
    """The engine's time in the window by kind of step (decode steps: each request's newest token; prompt
    steps: with prompt tokens): each kind's share of the window and its mean step in seconds (None
    without a step of that kind)."""
    out = {}
    for kind in ("decode", "prompt"):
        seconds, steps = d.delta(f"engine_{kind}_step_seconds_total"), d.delta(f"engine_{kind}_steps_total")
        out[kind] = {"share": rate(seconds), "step_s": seconds / steps if steps else None}
    return out


def _moe(layers: dict[str, float]) -> dict | None:
    if not layers:
        return None
    return {"max": max(layers.values()), "mean": sum(layers.values()) / len(layers), "layers": layers}


class _Delta:
    """The registry's values now, and how much they changed since `then`."""

    def __init__(self, now: Snapshot, then: Snapshot) -> None:
        self.now, self.then = now.samples, then.samples

    def value(self, name: str, labels: tuple = ()) -> float:
        return self.now.get((name, labels), 0.0)

    def delta(self, name: str, labels: tuple = ()) -> float:
        return max(self.value(name, labels) - self.then.get((name, labels), 0.0), 0.0)

    def delta_sum(self, name: str) -> float:
        """The change of `name` summed over its label values."""
        return sum(self.delta(name, labels) for n, labels in self.now if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """{value of `label`: the sample's value} over the samples of `name` carrying that label."""
        return {dict(labels)[label]: v for (n, labels), v in self.now.items() if n == name and label in dict(labels)}

    def percentiles(self, metric: str) -> dict:
        bound = lambda labels: float(dict(labels)["le"])
        keys = sorted((labels for n, labels in self.now if n == f"{metric}_bucket"), key=bound)
        window = [(bound(k), self.delta(f"{metric}_bucket", k)) for k in keys]
        count = window[-1][1] if window else 0.0
        return {
            "p50": quantile(0.5, window),
            "p99": quantile(0.99, window),
            "count": count,
            "mean": self.delta(f"{metric}_sum") / count if count else None,
        }

    def tiers(self, rate) -> dict[str, dict]:
        """Every series with a `tier` label (KV cache tiers: GPU, CPU, disk, ...), whatever its name:
        {tier: {"metrics": {name: {"value", "rate"}}, "hit_rate"}}; rates are per second over the
        window (None for gauges); the hit rate is `_tier_hit_rate`'s."""
        tiers: dict[str, dict] = {}
        for (name, labels), value in self.now.items():
            tier = dict(labels).get("tier")
            if tier is None or name.endswith(("_bucket", "_count", "_sum")):
                continue
            series = name if len(labels) == 1 else f"{name}{{{','.join(f'{k}={v}' for k, v in labels if k != 'tier')}}}"
            counter = name.endswith("_total")
            entry = {"value": value, "rate": rate(self.delta(name, labels)) if counter else None}
            tiers.setdefault(tier, {"metrics": {}})["metrics"][series] = entry
        for tier in tiers.values():
            tier["hit_rate"] = _tier_hit_rate(tier["metrics"])
        return tiers


def _tier_hit_rate(metrics: dict[str, dict]) -> float | None:
    """Since the start: a tier's counter named like hits over one named like lookups, or hits + misses."""

    def find(*words: str) -> float | None:
        names = (n for n in metrics if n.endswith("_total") and any(w in n for w in words))
        return next((metrics[n]["value"] for n in names if words == ("hit",) or "hit" not in n), None)

    hits, lookups, misses = find("hit"), find("quer", "lookup"), find("miss")
    if hits is None:
        return None
    if lookups is not None:
        return _ratio(hits, lookups)
    return _ratio(hits, hits + misses) if misses is not None else None
