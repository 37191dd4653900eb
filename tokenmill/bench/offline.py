"""`tokenmill bench offline`: the same workloads through the engine in-process (no HTTP, no server).

Measures the engine alone: requests are added to `LLMEngine` at their arrival times (the same arrival
process as `serve`, capped by `max_concurrency`) and the engine is stepped until all finish. Timings come
from the engine's own per-request metrics (monotonic clock): TTFT = first_token_time - arrival_time,
E2E = finished_time - arrival_time, ITL = gaps between token_times (one per token, so TPOT ~ mean ITL).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque

from tqdm.auto import tqdm

from tokenmill.bench.client import ABORTED, SKIPPED, LoadConfig, arrival_gaps
from tokenmill.bench.datasets import Session
from tokenmill.bench.metrics import RequestRecord, expert_load_summary, itl_from_times
from tokenmill.bench.monitor import ResourceMonitor
from tokenmill.bench.prometheus import step_summary
from tokenmill.bench.runner import RunOptions, make_result, num_requests, split_warmups

logger = logging.getLogger(__name__)


class _Conversation:
    """A session in flight: which turn is next, and the replies so far."""

    def __init__(self, index: int, session: Session, arrival: float):
        self.index, self.session, self.arrival = index, session, arrival
        self.turn = 0
        self.replies: list[str] = []

    @property
    def done(self) -> bool:
        return self.turn >= len(self.session.turns)


class OfflineRunner:
    """Drives an `LLMEngine` (anything with add_request/step/has_unfinished_requests/abort_request and a
    `tokenizer` with encode/apply_chat_template)."""

    def __init__(self, engine, chat: bool = False, temperature: float = 0.0, ignore_eos: bool = False):
        from tokenmill import SamplingParams

        self.engine = engine
        self.chat = chat
        self._params = lambda max_tokens: SamplingParams(
            max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
        )
        self._ids = 0
        self.kv_usage_max: float | None = None

    def _prompt(self, conv: _Conversation) -> str | list[int]:
        prompt = conv.session.prompt(conv.turn, conv.replies, self.chat)
        if isinstance(prompt, list):  # chat messages: the engine takes token ids from the chat template
            return self.engine.tokenizer.apply_chat_template(prompt)
        return prompt

    def run(
        self, sessions: list[Session], load: LoadConfig, progress: bool = True, desc: str = "offline"
    ) -> tuple[list[RequestRecord], float]:
        load.validate()
        gaps = arrival_gaps(len(sessions), load.request_rate, load.burstiness, load.seed)
        t0 = time.monotonic()
        arrivals, at = deque(), t0
        for i, (gap, session) in enumerate(zip(gaps, sessions)):
            at += gap
            arrivals.append(_Conversation(i, session, at))
        ready: deque[_Conversation] = deque()  # arrived (or next turn due), waiting for a concurrency slot
        in_flight: dict[str, tuple[_Conversation, RequestRecord, float]] = {}
        records: list[RequestRecord] = []
        deadline = t0 + load.max_duration if load.max_duration else None
        bar = tqdm(
            total=num_requests(sessions), desc=desc, unit="req", disable=not progress, file=sys.stderr, leave=False
        )
        try:
            while arrivals or ready or in_flight:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._abort(in_flight, now)
                    break
                while arrivals and arrivals[0].arrival <= now:
                    ready.append(arrivals.popleft())
                while ready and (load.max_concurrency is None or len(in_flight) < load.max_concurrency):
                    self._start(ready.popleft(), t0, in_flight, records, bar)
                if not in_flight:
                    if arrivals:  # idle until the next arrival
                        time.sleep(max(0.0, min(arrivals[0].arrival, deadline or float("inf")) - time.monotonic()))
                    continue
                for out in self.engine.step():
                    if out.finished and out.request_id in in_flight:
                        conv = self._finish(out, in_flight, t0, bar)
                        if conv is not None:
                            ready.append(conv)
                usage = kv_usage(self.engine)
                if usage is not None:
                    self.kv_usage_max = max(usage, self.kv_usage_max or 0.0)
        finally:
            bar.close()
        duration = time.monotonic() - t0
        records.sort(key=lambda r: (r.start, r.session, r.turn))
        return records, duration

    def _start(self, conv, t0, in_flight, records, bar) -> None:
        turn = conv.session.turns[conv.turn]
        record = RequestRecord(
            session=conv.index, turn=conv.turn, expected_output_len=turn.output_len, expected_prompt_len=turn.prompt_len
        )
        records.append(record)
        prompt = self._prompt(conv)
        request_id = f"bench-{self._ids}"
        self._ids += 1
        arrival = time.monotonic()
        record.start = arrival - t0
        try:
            self.engine.add_request(request_id, prompt, self._params(turn.output_len), arrival_time=arrival)
        except ValueError as e:  # rejected (too long for the context or the KV cache)
            record.error, record.e2e = f"rejected: {e}", 0.0
            bar.update(1)
            self._skip_rest(conv, record, records, bar)
            return
        in_flight[request_id] = (conv, record, arrival)

    def _finish(self, out, in_flight, t0, bar) -> _Conversation | None:
        conv, record, arrival = in_flight.pop(out.request_id)
        sample, m = out.outputs[0], out.metrics
        record.prompt_tokens = len(out.prompt_token_ids)
        record.cached_tokens = out.num_cached_tokens
        record.output_tokens, record.output_tokens_source = len(sample.token_ids), "engine"
        record.num_chunks = len(m.token_times)
        record.finish_reason = sample.finish_reason
        record.ttft = None if m.first_token_time is None else m.first_token_time - arrival
        record.e2e = (m.finished_time or time.monotonic()) - arrival
        record.itl = itl_from_times(m.token_times)
        record.output_text = sample.text
        record.success = sample.finish_reason != "abort"
        record.error = "" if record.success else "aborted by the engine"
        bar.update(1)
        conv.replies.append(sample.text)
        conv.turn += 1
        return None if conv.done or not record.success else conv

    def _skip_rest(self, conv, record, records, bar) -> None:
        for j in range(conv.turn + 1, len(conv.session.turns)):
            records.append(
                RequestRecord(
                    session=conv.index,
                    turn=j,
                    error=SKIPPED,
                    start=record.start,
                    expected_output_len=conv.session.turns[j].output_len,
                )
            )
            bar.update(1)

    def _abort(self, in_flight, now) -> None:
        for request_id, (_, record, arrival) in in_flight.items():
            self.engine.abort_request(request_id)
            record.error, record.e2e = ABORTED, now - arrival
        in_flight.clear()


def step_counts(times) -> dict[str, dict[str, float]]:
    """The engine's `StepTimes` as the counts /metrics gives of them ({kind: {steps, tokens, seconds}})."""
    return {
        kind: {
            "steps": getattr(times, f"{kind}_steps"),
            "tokens": getattr(times, f"{kind}_step_tokens"),
            "seconds": getattr(times, f"{kind}_step_seconds"),
        }
        for kind in ("decode", "prompt")
    }


def load_engine(args):
    """An LLMEngine sized by the engine flags (`tokenmill.engine_args.add_engine_args`)."""
    try:
        from tokenmill.engine.llm_engine import LLMEngine
        from tokenmill.engine_args import engine_config_from_args
    except ImportError as e:
        raise RuntimeError(f"`bench offline` needs tokenmill's engine (tokenmill.engine.llm_engine): {e}") from e
    return LLMEngine(engine_config_from_args(args))


def run_offline(
    engine, opts: RunOptions, chat: bool = False, temperature: float = 0.0, ignore_eos: bool = False
) -> dict:
    """Benchmark `engine` in-process with the workload and load of `opts`."""
    runner = OfflineRunner(engine, chat, temperature, ignore_eos)
    warmups, sessions = split_warmups(opts, chat)
    if warmups:
        runner.run(warmups, LoadConfig(max_concurrency=opts.load.max_concurrency), opts.progress, "warm-up")
    stats = engine.core.stats()
    kv_before, experts_before, steps_before = kv_usage(engine), stats.expert_tokens, stats.steps
    with ResourceMonitor(os.getpid()) as monitor:  # this process is the engine
        records, duration = runner.run(sessions, opts.load, opts.progress, opts.label or "offline")
    stats = engine.core.stats()
    ok = [r for r in records if r.success]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    server_metrics = {
        "exposed": True,
        "prefix_cache_queries": prompt,
        "prefix_cache_hits": cached,
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
        "kv_cache_usage_before": kv_before,
        "kv_cache_usage_after": kv_usage(engine),
        "kv_cache_usage_max": runner.kv_usage_max,
        "moe": expert_load_summary(
            [
                [n - b for n, b in zip(c, experts_before.get(layer, [0] * len(c)))]
                for layer, c in sorted(stats.expert_tokens.items())
            ]
        ),
        "steps": step_summary(step_counts(steps_before), step_counts(stats.steps)),
    }
    return make_result("offline", opts, records, duration, num_requests(sessions), server_metrics, monitor.summary())


def kv_usage(engine) -> float | None:
    """The engine's KV-cache usage (a fraction), if it reports one."""
    try:
        return engine.core.stats().kv_cache_usage
    except AttributeError:
        return None
