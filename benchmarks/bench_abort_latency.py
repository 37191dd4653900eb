"""Abort-to-free latency under load: how long an abort that arrives while a long prompt is being
prefilled waits before the request's KV blocks are back in the pool, with and without `--max-step-ms`.

    .venv/bin/python benchmarks/bench_abort_latency.py [--prompt-len 512] [--trials 6] [--max-step-ms 0,250]

One engine (`--max-num-batched-tokens 2048`: the long prompt is one chunk) runs four decoding
requests as load. Per trial a long-prompt request is added and, at a random moment in its prefill, a
timer thread asks for its abort; the step loop takes the abort between steps (as the server's core
process does) and the latency is the time from the ask to the blocks being free. The variants run
back to back on the same engine (the bound is switched on the scheduler's `StepBudget`), alternating
trial by trial, so machine noise falls on both; also reported: the time a long prompt's whole prefill
takes alone under the same load (what the smaller chunks cost).
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=512,
        help="length in tokens of the long prompt that is aborted (default: %(default)s)",
    )
    ap.add_argument("--trials", type=int, default=6, help="aborts per --max-step-ms variant (default: %(default)s)")
    ap.add_argument(
        "--max-step-ms",
        default="0,250",
        help="step-time bounds to compare, in ms, comma-separated; 0 = no bound (default: %(default)s)",
    )
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_batched_tokens=2048, kv_cache_memory=1.0)
    engine, rng = llm.engine, random.Random(0)
    core = engine.core
    load = SamplingParams(temperature=0, max_tokens=100_000 // 64, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"load-{i}", [rng.randrange(1000, 20000) for _ in range(32)], load)
    variants = [float(v) for v in args.max_step_ms.split(",")]
    latencies: dict[float, list[float]] = {v: [] for v in variants}
    prefill: dict[float, list[float]] = {v: [] for v in variants}
    once = SamplingParams(temperature=0, max_tokens=1)
    for trial in range(args.trials):
        for v in variants:
            core.scheduler.step_budget.max_seconds = v / 1000
            prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
            rid = f"long-{trial}-{v}"
            engine.add_request(rid, prompt, once)  # a whole prefill first: its time under this bound
            start = time.perf_counter()
            while rid in core.requests:
                engine.step()
            prefill[v].append(time.perf_counter() - start)
            latency = _abort_latency(engine, rid + "-abort", prompt[::-1], once, prefill[v][-1], rng)
            latencies[v].append(latency)
            print(
                f"trial {trial} max-step-ms {v:g}: prefill {prefill[v][-1]:.2f} s, abort->free {latency:.3f} s, "
                f"step budget {core.scheduler.step_budget.tokens} tokens",
                flush=True,
            )
        _keep_load(engine, load, rng)
    print(
        f"# {args.model}, prompt {args.prompt_len} tokens, 4 decoding requests beside it, {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'max-step-ms':>11} {'aborts':>6} {'abort->free median ms':>22} {'p90 ms':>8} {'max ms':>8} {'prefill s':>10}"
    )
    for v in variants:
        lat = sorted(latencies[v])
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        print(
            f"{v:>11g} {len(lat):>6} {statistics.median(lat) * 1e3:>22.0f} {p90 * 1e3:>8.0f} {lat[-1] * 1e3:>8.0f} "
            f"{statistics.median(prefill[v]):>10.2f}"
        )


def _abort_latency(engine, rid: str, prompt: list[int], params, prefill_seconds: float, rng) -> float:
    """Add a long prompt, ask for its abort at a random moment of its prefill, run the step loop until
    the abort is taken; the seconds from the ask to its blocks being free (at that step boundary: by
    the abort, or by its end if the step that was running when the abort came finished its prompt)."""
    core, asks = engine.core, queue.Queue()
    engine.add_request(rid, prompt, params)
    threading.Timer(rng.uniform(0.05, 0.8) * prefill_seconds, lambda: asks.put(time.perf_counter())).start()
    while True:
        try:
            asked = asks.get_nowait()
        except queue.Empty:
            engine.step()
            continue
        engine.abort_request(rid)
        freed = time.perf_counter()
        if rid in core.requests:
            raise RuntimeError("the abort did not free the request's blocks")
        return freed - asked


def _keep_load(engine, params, rng) -> None:
    """Keep four decoding requests running (replace any that finished)."""
    for i in range(4):
        if f"load-{i}" not in engine.core.requests:
            engine.add_request(f"load-{i}", [rng.randrange(1000, 20000) for _ in range(32)], params)


if __name__ == "__main__":
    main()
