"""A window of a server's `/metrics`: counters and histograms as deltas between the first and the last
scrape, gauges (running, waiting, KV use) as their peaks over scrapes taken every `interval` seconds in
between, in a background thread. tokenmill's names first, then vLLM's; whatever a server does not
export stays None.
"""

from __future__ import annotations

import math
import threading
import time

from tokenmill.bench import prometheus
from tokenmill.bench.prometheus import Sample

COUNTERS = {
    "preemptions": ("tokenmill:num_preemptions_total", "vllm:num_preemptions_total"),
    "prompt_tokens": ("tokenmill:prompt_tokens_total", "vllm:prompt_tokens_total"),
    "generation_tokens": ("tokenmill:generation_tokens_total", "vllm:generation_tokens_total"),
    "prefix_queries": prometheus.PREFIX_QUERIES,
    "prefix_hits": prometheus.PREFIX_HITS,
    # the whole server's CPU (tokenmill), else the API process's own (what prometheus_client exports)
    "cpu_seconds": ("tokenmill:server_cpu_seconds_total", "process_cpu_seconds_total"),
}
GAUGES = {
    "running": ("tokenmill:num_requests_running", "vllm:num_requests_running"),
    "waiting": ("tokenmill:num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_usage": prometheus.KV_USAGE,
}
HISTOGRAMS = {
    "ttft": ("tokenmill:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "itl": ("tokenmill:inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
    "queue": ("tokenmill:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
}
FULL = 0.9  # KV use at or above this is a full pool (blocks are handed out whole)


def histogram_delta(before: list[Sample], after: list[Sample], names: tuple[str, ...]) -> dict[float, float] | None:
    """{upper bound: observations at or below it} added between the two scrapes (None: not exported)."""
    for name in names:
        after_buckets = _buckets(after, name)
        if after_buckets:
            before_buckets = _buckets(before, name)
            return {le: n - before_buckets.get(le, 0.0) for le, n in sorted(after_buckets.items())}
    return None


def _buckets(samples: list[Sample], name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for s in samples:
        if s.name == f"{name}_bucket" and "le" in s.labels:
            le = math.inf if s.labels["le"] in ("+Inf", "inf") else float(s.labels["le"])
            out[le] = out.get(le, 0.0) + s.value
    return out


def histogram_quantile(buckets: dict[float, float] | None, q: float) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket holding the q-th observation; the
    last finite bound when it falls in +Inf; None without observations."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


class MetricsWindow:
    """`with MetricsWindow(url) as w: ...traffic...`, then `w.summary()`. `available` is False when
    the server has no readable /metrics (then the probe's own timings are all there is)."""

    def __init__(self, metrics_url: str, interval: float = 0.1):
        self.url, self.interval = metrics_url, interval
        self.first: list[Sample] | None = None
        self.last: list[Sample] | None = None
        self.peaks: dict[str, float] = {}
        self.waiting_while_full = 0  # scrapes that saw requests waiting with the KV pool full
        self.scrapes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="doctor-metrics", daemon=True)

    @property
    def available(self) -> bool:
        return self.first is not None

    def __enter__(self) -> MetricsWindow:
        self._start = time.monotonic()
        self.first = self._scrape()
        if self.first is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.first is not None:
            self.last = self._scrape() or self.last
        self.seconds = time.monotonic() - self._start

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._scrape()

    def _scrape(self) -> list[Sample] | None:
        samples = prometheus.scrape(self.url, timeout=5.0)
        if samples is None:
            return None
        self.last = samples
        self.scrapes += 1
        values = {key: prometheus.metric_value(samples, names) for key, names in GAUGES.items()}
        for key, value in values.items():
            if value is not None:
                self.peaks[key] = max(self.peaks.get(key, 0.0), value)
        if (values["waiting"] or 0) > 0 and (values["kv_usage"] or 0) >= FULL:
            self.waiting_while_full += 1
        return samples

    def summary(self) -> dict:
        """Deltas, peaks and latency quantiles over the window (seconds); {} without /metrics."""
        if not self.available:
            return {}
        first, last = self.first, self.last or self.first
        out: dict = {"seconds": self.seconds, "scrapes": self.scrapes, "waiting_while_full": self.waiting_while_full}
        for key, names in COUNTERS.items():
            a, b = prometheus.metric_value(last, names), prometheus.metric_value(first, names)
            out[key] = None if a is None or b is None else a - b
        out["cpu_source"] = next((n for n in COUNTERS["cpu_seconds"] if any(s.name == n for s in last)), None)
        for key in GAUGES:
            out[f"peak_{key}"] = self.peaks.get(key)
        for key, names in HISTOGRAMS.items():
            buckets = histogram_delta(first, last, names)
            out[f"{key}_count"] = buckets[max(buckets)] if buckets else None
            for q in (50, 90, 99):
                out[f"{key}_p{q}"] = histogram_quantile(buckets, q / 100)
        out["engine"] = prometheus.engine_info(last)
        return out
