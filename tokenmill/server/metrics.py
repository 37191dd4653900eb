"""Prometheus metrics (named like vLLM's, `tokenmill:` prefix) and the server's stats log lines.

Everything is observed in the front end from the engine's own monotonic timestamps (the core
stamps first-scheduled and every token with `time.monotonic()`; the front end stamps arrival with
the same system-wide clock). Each app gets a private `CollectorRegistry`, so several servers (or
tests) in one process never collide.
"""

from __future__ import annotations

import logging
import os
import time

import psutil
from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from tokenmill.engine.output_processor import RequestOutput

logger = logging.getLogger("tokenmill.server")

# fmt: off
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                      5.0)
# fmt: on
# the KV-cache tiers' counters (tokenmill.kv_transfer.disk_tier.TierStats), each labelled by tier
_KV_TIER_METRICS = {
    "queries": "Prompt tokens looked up in a KV-cache tier (past the pool's prefix-cache hits).",
    "hits": "Prompt tokens found in a KV-cache tier and loaded into the pool.",
    "loads": "Requests whose tier hit was loaded.",
    "recomputes": "Requests whose tier hit was too short to pay a load (recomputed instead).",
    "load_bytes": "KV bytes loaded from a tier.",
    "load_seconds": "Time loading from a tier: reading and verifying files, copying into the pool.",
    "bad_files": "Truncated, corrupt or foreign files found in a tier (removed; a miss).",
    "saved_blocks": "KV blocks written to a tier.",
    "saved_bytes": "KV bytes written to a tier.",
    "save_seconds": "Step-loop time spent copying blocks out of the pool for a tier.",
    "write_seconds": "Background time spent writing a tier's files.",
    "dropped_blocks": "KV blocks not written to a tier (its queue full, writing off, or every RAM slot busy in the step).",
    "evicted_blocks": "KV blocks removed from a tier to stay under its size limit.",
    "errors": "Writes to a tier that failed (writing is then off).",
    "usage_bytes": "Bytes a tier holds (the disk tier's files, the RAM tier's slots in use).",
    "capacity_bytes": "The most a tier may hold.",
}
_KV_TIER_GAUGES = {"usage_bytes", "capacity_bytes"}
# the core's cumulative counters (`core_process.stats_snapshot`): stats key -> help. Each metric goes up
# by the change since the last snapshot; it is named as its key, or as _CORE_COUNTER_NAMES says
_CORE_COUNTERS = {
    "num_preemptions": "Requests preempted by the scheduler.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (of those looked up).",
    "grammar_compiles": "Structured-output grammars compiled (grammar cache misses).",
    "grammar_compile_seconds": "Total time spent compiling structured-output grammars.",
    "spec_drafts": "Speculative decoding: verify steps of a request.",
    "spec_draft_tokens": "Speculative decoding: drafted tokens verified.",
    "spec_accepted_tokens": "Speculative decoding: drafted tokens accepted.",
    "spec_draft_seconds": "Speculative decoding: time spent drafting (the model runner's drafter).",
    "spec_verify_seconds": "Speculative decoding: time of the engine steps that verified drafts.",
    "kv_transfers": "Disaggregated prefill/decode: prompts whose KV was sent (producer) or received (consumer).",
    "kv_transfer_bytes": "Disaggregated prefill/decode: KV bytes of those prompts.",
    "kv_transfer_seconds": "Disaggregated prefill/decode: producer, time copying KV out; consumer, from asking for it until it is in.",
    "step_failures": "Engine steps that raised (their requests are retried in halves to find the one at fault).",
    "requests_failed_isolated": "Requests found to make a step fail and finished with an error (the others in the step went on).",
    "decode_steps": "Engine steps that computed only each request's newest token (decodes; speculative verify steps).",
    "decode_step_tokens": "Tokens computed by decode steps.",
    "decode_step_seconds": "Time of decode steps (submit to result).",
    "prompt_steps": "Engine steps that computed prompt tokens (prefill chunks, alone or beside decodes; recomputes).",
    "prompt_step_tokens": "Tokens computed by prompt steps (their decodes included).",
    "prompt_step_seconds": "Time of prompt steps (submit to result).",
}
_CORE_COUNTER_NAMES = {
    "grammar_compiles": "structured_output_compiles",
    "grammar_compile_seconds": "structured_output_compile_seconds",
    "spec_drafts": "spec_decode_num_drafts",
    "spec_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_draft_seconds": "spec_decode_draft_seconds",
    "spec_verify_seconds": "spec_decode_verify_seconds",
    **{
        f"{kind}_{what}": f"engine_{kind}_{what}"
        for kind in ("decode", "prompt")
        for what in ("steps", "step_tokens", "step_seconds")
    },
}
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, model_name: str, log_requests: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.log_requests = log_requests
        r, labels, name = self.registry, ["model_name"], model_name

        def hist(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(f"tokenmill:{metric}", doc, labels, registry=r, buckets=buckets).labels(name)

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{metric}", doc, labels, registry=r).labels(name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(f"tokenmill:{metric}", doc, labels, registry=r).labels(name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Gap between consecutive tokens of a request.", _TOKEN_GAP_BUCKETS
        )
        self.tpot = hist(
            "time_per_output_token_seconds", "Mean decode time per output token of a request.", _TOKEN_GAP_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.free_blocks = gauge("num_free_kv_blocks", "KV cache blocks in the free pool.")
        self.total_blocks = gauge("num_kv_blocks", "KV cache blocks in the pool.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.core_counters = {
            key: counter(_CORE_COUNTER_NAMES.get(key, key), doc) for key, doc in _CORE_COUNTERS.items()
        }
        self.spec_per_position = Counter(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafted tokens accepted, by draft position (0 first).",
            ["model_name", "position"],
            registry=r,
        )
        self.kv_tier = {
            key: (Gauge if key in _KV_TIER_GAUGES else Counter)(
                f"tokenmill:kv_tier_{key}", doc, ["model_name", "tier"], registry=r
            )
            for key, doc in _KV_TIER_METRICS.items()
        }
        self.engine_restarts = counter("engine_restarts", "Times the engine core was restarted after it died or hung.")
        self.success = Counter(
            "tokenmill:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.expert_tokens = Counter(
            "tokenmill:moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer.",
            ["model_name", "layer", "expert"],
            registry=r,
        )
        self.expert_imbalance = Gauge(
            "tokenmill:moe_load_imbalance",
            "Per MoE layer: tokens of its busiest expert / the mean over its experts "
            "(since the engine started; 1 is even).",
            ["model_name", "layer"],
            registry=r,
        )
        self.rank_tokens = Counter(
            "tokenmill:moe_rank_tokens",
            "Expert parallelism: tokens routed to the experts "
            "each rank holds (a token counts once per chosen expert), over all MoE layers.",
            ["model_name", "rank"],
            registry=r,
        )
        self.rank_imbalance = Gauge(
            "tokenmill:moe_rank_imbalance",
            "Expert parallelism: tokens of the busiest "
            "rank's experts / the mean over ranks (since the engine started; 1 is even).",
            ["model_name"],
            registry=r,
        )
        self.engine_info = Info(
            "tokenmill:engine_config",
            "The engine's settings and this machine's cores, for tools that diagnose a deployment (tokenmill doctor).",
            labels,
            registry=r,
        )
        r.register(_ServerCPU())
        self._model_name = model_name
        self._started: set[str] = set()  # requests whose prompt tokens were counted
        self._last_stats: dict = {}
        self._window_start = time.monotonic()
        self._window_prompt = self._window_gen = 0
        self.stats: dict = {}

    def set_engine_info(self, config, ready: dict) -> None:
        """`tokenmill:engine_config_info`: the settings a diagnosis turns on (`config`: the
        `EngineConfig`; `ready`: the core's ready info: its KV pool, threads, model file)."""
        spec = config.speculative
        values = {
            "model_path": ready["model_path"],
            "device": ready["device"],
            "dtype": ready["dtype"],
            "quantization": config.quantization,
            "max_model_len": ready["max_model_len"],
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "kv_cache_dtype": config.cache.cache_dtype,
            "kv_cache_bytes": ready["kv_cache_bytes"],
            "block_size": ready["block_size"],
            "num_kv_blocks": ready["num_blocks"],
            "capacity_tokens": ready["capacity_tokens"],
            "speculative": spec.method if spec is not None else "off",
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "engine_threads": ready.get("num_threads", 0) * config.parallel.world_size,
            "cpu_count": os.cpu_count() or 0,
            "huge_pages": ready.get("huge_pages", "unknown"),
        }
        self.engine_info.labels(self._model_name).info({k: str(v) for k, v in values.items()})

    # ---- engine events (called on the event loop by the EngineClient) ---------------------------

    def on_outputs(self, results: list[RequestOutput]) -> None:
        for r in results:
            new = sum(len(o.delta_token_ids) for o in r.outputs)
            self.generation_tokens.inc(new)
            self._window_gen += new
            if r.request_id not in self._started and new:
                self._started.add(r.request_id)
                n_prompt = len(r.prompt_token_ids)
                self.prompt_tokens.inc(n_prompt)
                self._window_prompt += n_prompt
            if r.finished:
                self._started.discard(r.request_id)
                self._observe_finished(r)

    def on_abort(self, r: RequestOutput) -> None:
        self._started.discard(r.request_id)
        self.success.labels(self._model_name, "abort").inc()
        if self.log_requests:
            logger.info(
                "request %s aborted after %d output tokens", r.request_id, sum(len(o.token_ids) for o in r.outputs)
            )

    def on_restart(self) -> None:
        """A new engine core: its cumulative counters start again from zero."""
        self.engine_restarts.inc()
        self._last_stats = {}
        self._started.clear()

    def on_stats(self, s: dict) -> None:
        self.stats = s
        self.running.set(s.get("num_running", 0))
        self.waiting.set(s.get("num_waiting", 0))
        self.kv_usage.set(s.get("kv_cache_usage", 0.0))
        self.free_blocks.set(s.get("num_free_blocks", 0))
        self.total_blocks.set(s.get("num_blocks", 0))
        for key, counter in self.core_counters.items():
            self._inc_delta(counter, s, key)
        self._on_kv_tiers(s.get("kv_tiers") or {}, self._last_stats.get("kv_tiers") or {})
        before = self._last_stats.get("spec_accepted_per_position") or []
        for pos, count in enumerate(s.get("spec_accepted_per_position") or []):
            delta = count - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                self.spec_per_position.labels(self._model_name, str(pos)).inc(delta)
        self._on_expert_tokens(s.get("expert_tokens") or {}, self._last_stats.get("expert_tokens") or {})
        self._on_rank_tokens(s.get("moe_rank_tokens") or [], self._last_stats.get("moe_rank_tokens") or [])
        self._last_stats = s

    def _on_expert_tokens(self, counts: dict[int, list[int]], before: dict[int, list[int]]) -> None:
        for layer, layer_counts in counts.items():
            old = before.get(layer) or [0] * len(layer_counts)
            for expert, (now, then) in enumerate(zip(layer_counts, old)):
                child = self.expert_tokens.labels(self._model_name, str(layer), str(expert))  # 0 until routed to
                if now > then:
                    child.inc(now - then)
            if sum(layer_counts):
                self.expert_imbalance.labels(self._model_name, str(layer)).set(
                    max(layer_counts) * len(layer_counts) / sum(layer_counts)
                )

    def _on_rank_tokens(self, counts: list[int], before: list[int]) -> None:
        for rank, now in enumerate(counts):
            then = before[rank] if rank < len(before) else 0
            self.rank_tokens.labels(self._model_name, str(rank)).inc(max(now - then, 0))
        if sum(counts):
            self.rank_imbalance.labels(self._model_name).set(max(counts) * len(counts) / sum(counts))

    def _on_kv_tiers(self, tiers: dict[str, dict], before: dict[str, dict]) -> None:
        for tier, counts in tiers.items():
            for key, metric in self.kv_tier.items():
                child = metric.labels(self._model_name, tier)
                if key in _KV_TIER_GAUGES:
                    child.set(counts.get(key, 0))
                else:
                    child.inc(max(counts.get(key, 0) - before.get(tier, {}).get(key, 0), 0))

    def _inc_delta(self, counter: Counter, s: dict, key: str) -> None:
        delta = s.get(key, 0) - self._last_stats.get(key, 0)
        if delta > 0:
            counter.inc(delta)

    def _observe_finished(self, r: RequestOutput) -> None:
        m = r.metrics
        reasons = [o.finish_reason or "abort" for o in r.outputs]
        for reason in reasons:
            self.success.labels(self._model_name, reason).inc()
        times = m.token_times
        if not times or m.first_token_time is None:
            return
        ttft = m.first_token_time - m.arrival_time
        e2e = (m.finished_time or times[-1]) - m.arrival_time
        self.ttft.observe(max(ttft, 0.0))
        self.e2e.observe(max(e2e, 0.0))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        self.decode_time.observe(max(times[-1] - m.first_token_time, 0.0))
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        tpot = (e2e - ttft) / (len(times) - 1) if len(times) > 1 else None
        if tpot is not None:
            self.tpot.observe(max(tpot, 0.0))
        if self.log_requests:
            n_out = sum(len(o.token_ids) for o in r.outputs)
            tpot_text = f"{tpot * 1000:.1f} ms" if tpot is not None else "-"
            logger.info(
                "request %s finished: %d prompt + %d output tokens, TTFT %.3f s, TPOT %s, reason %s",
                r.request_id,
                len(r.prompt_token_ids),
                n_out,
                ttft,
                tpot_text,
                ",".join(reasons),
            )

    # ---- output ---------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_throughput(self, force: bool = False) -> None:
        """The periodic line: throughput since the last call, queue sizes and KV usage."""
        now = time.monotonic()
        elapsed = max(now - self._window_start, 1e-9)
        s = self.stats
        active = self._window_prompt or self._window_gen or s.get("num_running") or s.get("num_waiting")
        if active or force:
            queries = s.get("prefix_cache_queries", 0)
            hit_rate = 100 * s.get("prefix_cache_hits", 0) / queries if queries else 0.0
            logger.info(
                "throughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | "
                "KV cache %.1f%% used (%d/%d blocks free) | prefix cache hit rate %.1f%% | preemptions %d",
                self._window_prompt / elapsed,
                self._window_gen / elapsed,
                s.get("num_running", 0),
                s.get("num_waiting", 0),
                100 * s.get("kv_cache_usage", 0.0),
                s.get("num_free_blocks", 0),
                s.get("num_blocks", 0),
                hit_rate,
                s.get("num_preemptions", 0),
            )
        self._window_start, self._window_prompt, self._window_gen = now, 0, 0


class _ServerCPU:
    """`tokenmill:server_cpu_seconds_total`: CPU seconds of the server's processes (this front end,
    the engine core and its workers), read when /metrics is scraped; its rate over a window is the
    cores the deployment keeps busy (a process's own `process_cpu_seconds_total` misses the core)."""

    def __init__(self) -> None:
        self.root = psutil.Process()

    def collect(self):
        seconds = 0.0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = [self.root]
        for p in procs:
            try:
                seconds += sum(p.cpu_times()[:2])
            except psutil.Error:  # gone while we looked
                continue
        yield CounterMetricFamily(
            "tokenmill:server_cpu_seconds", "CPU seconds of the server: front end, engine core and workers.", seconds
        )
