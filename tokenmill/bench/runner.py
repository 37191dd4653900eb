"""One benchmark run against a server (workload, warm-up, load, /metrics and utilization) and sweeps of runs.

A run's result is a plain dict (what the JSON file holds):
  kind "serve" | "offline", label, created, config (the options), summary (metrics.summarize),
  server_metrics (prefix cache / KV usage), utilization, cost, requests (one dict per request).
A sweep's: kind "sweep", sweep_by ("max_concurrency" or "request_rate"), points (run results, each with
"load"), knee (the highest load meeting the SLO, or None).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

from tokenmill.bench import prometheus
from tokenmill.bench.client import EndpointConfig, LoadConfig, run_load
from tokenmill.bench.datasets import BenchTokenizer, DatasetConfig, Session, build_sessions
from tokenmill.bench.metrics import RequestRecord, cost_metrics, find_knee, summarize
from tokenmill.bench.monitor import ResourceMonitor, local_server_pid

logger = logging.getLogger(__name__)
RESULT_FORMAT = 1


@dataclass
class RunOptions:
    """Everything one run needs besides the target (an endpoint, or the engine offline)."""

    dataset: DatasetConfig
    load: LoadConfig = field(default_factory=LoadConfig)
    tokenizer: BenchTokenizer | None = None
    num_warmups: int = 0
    slo: dict = field(default_factory=dict)
    cost_per_hour: float | None = None
    progress: bool = True
    label: str = ""
    config: dict = field(default_factory=dict)  # recorded as given (e.g. the CLI flags)


def split_warmups(opts: RunOptions, chat: bool) -> tuple[list[Session], list[Session]]:
    """(warm-up sessions, measured sessions): one workload, the first `num_warmups` sessions set apart."""
    cfg = dataclasses.replace(opts.dataset, num_prompts=opts.dataset.num_prompts + opts.num_warmups)
    sessions = build_sessions(cfg, opts.tokenizer, chat)
    return sessions[: opts.num_warmups], sessions[opts.num_warmups :]


def make_result(
    kind: str,
    opts: RunOptions,
    records: list[RequestRecord],
    duration: float,
    planned: int,
    server_metrics: dict,
    utilization: dict,
) -> dict:
    """The result dict of a run; `planned` requests were in the workload (the difference from the records:
    never sent, the run having reached --max-duration)."""
    summary = summarize(records, duration, opts.slo)
    summary["planned_requests"] = planned
    return {
        "tokenmill_bench": RESULT_FORMAT,
        "kind": kind,
        "label": opts.label,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": opts.config,
        "summary": summary,
        "server_metrics": server_metrics,
        "utilization": utilization,
        "cost": cost_metrics(opts.cost_per_hour, summary),
        "requests": [r.to_dict() for r in records],
    }


def _count_tokens(tokenizer: BenchTokenizer | None):
    return (lambda text: tokenizer.count(text, add_special_tokens=False)) if tokenizer else None


def run_serve(endpoint: EndpointConfig, opts: RunOptions, server_pid: int | None = None) -> dict:
    """Benchmark the server at `endpoint` with the workload and load of `opts`."""
    warmups, sessions = split_warmups(opts, endpoint.chat)
    count = _count_tokens(opts.tokenizer)
    if warmups:
        warm_load = LoadConfig(max_concurrency=opts.load.max_concurrency)
        records, _ = asyncio.run(run_load(warmups, endpoint, warm_load, count, opts.progress, "warm-up"))
        failed = [r for r in records if not r.success]
        if failed:
            logger.warning("%d of %d warm-up requests failed: %s", len(failed), len(records), failed[0].error)
    url = prometheus.metrics_url(endpoint.base_url)
    before = _cache_stats(url, endpoint.model)
    pid = server_pid or local_server_pid(endpoint.base_url)
    with ResourceMonitor(pid, url if before else None, model=endpoint.model) as monitor:
        records, duration = asyncio.run(
            run_load(sessions, endpoint, opts.load, count, opts.progress, opts.label or "bench")
        )
    after = _cache_stats(url, endpoint.model) if before else None
    return make_result(
        "serve",
        opts,
        records,
        duration,
        num_requests(sessions),
        prometheus.cache_delta(before, after, monitor.kv_samples),
        monitor.summary(),
    )


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def _cache_stats(url: str, model: str) -> dict | None:
    samples = prometheus.scrape(url)
    return prometheus.cache_stats(samples, model) if samples is not None else None


def run_sweep(run_one, opts: RunOptions, loads: list[float], sweep_by: str, min_attainment: float) -> dict:
    """`run_one(opts)` at each load (a `max_concurrency` or a `request_rate`), each with its own prompts
    (seed + i, so one point's prompts are not in the prefix cache for the next); warm-ups before the first."""
    if sweep_by not in ("max_concurrency", "request_rate"):
        raise ValueError(f"cannot sweep over {sweep_by!r}")
    if sweep_by == "max_concurrency" and not all(math.isfinite(x) and x == int(x) for x in loads):
        raise ValueError("--concurrencies must be whole numbers")
    points = []
    for i, load in enumerate(loads):
        load_cfg = dataclasses.replace(opts.load, **{sweep_by: int(load) if sweep_by == "max_concurrency" else load})
        point_opts = dataclasses.replace(
            opts,
            load=load_cfg,
            dataset=dataclasses.replace(opts.dataset, seed=opts.dataset.seed + i),
            num_warmups=opts.num_warmups if i == 0 else 0,
            label=f"{sweep_by}={load:g}",
            config=dict(opts.config, **{sweep_by: load}),
        )
        result = run_one(point_opts)
        result["load"] = load
        points.append(result)
    knee = find_knee(points, min_attainment) if opts.slo else None
    return {
        "tokenmill_bench": RESULT_FORMAT,
        "kind": "sweep",
        "label": opts.label,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": opts.config,
        "sweep_by": sweep_by,
        "slo": {k: v * 1000 for k, v in opts.slo.items()},
        "min_slo_attainment": min_attainment,
        "knee": None
        if knee is None
        else {
            "load": knee["load"],
            "goodput": knee["summary"]["goodput"],
            "request_throughput": knee["summary"]["request_throughput"],
        },
        "points": points,
    }


def parse_loads(text: str) -> list[float]:
    """ "1,2,4,inf" -> [1.0, 2.0, 4.0, inf]; positive and increasing order not required."""
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"bad load list {text!r}: expected comma-separated numbers") from e
    if not loads or any(not (x > 0) or math.isnan(x) for x in loads):
        raise ValueError(f"bad load list {text!r}: expected positive numbers")
    return loads
