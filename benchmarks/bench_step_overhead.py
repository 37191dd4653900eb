"""Engine step overhead: time per decode step spent outside the model's forward pass.

    .venv/bin/python benchmarks/bench_step_overhead.py [--batch-sizes 1,64] [--steps 30]

For each batch size, N requests decode together; each step is timed in full and the executor's
`execute` (runner state updates, input tensors, forward, logits, sampling) is timed inside it.
Overhead = step - execute: scheduling, grammar masks, the scheduler's update, output building.
Medians over --steps steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument(
        "--batch-sizes",
        default="1,64",
        help="requests decoding together, comma-separated: one row each (default: %(default)s)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=30,
        help="decode steps timed per batch size, medians reported (default: %(default)s)",
    )
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default: %(default)s)")
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=256, kv_cache_memory=2.0)
    engine = llm.engine
    executor = engine.core.executor
    forward_times: list[float] = []
    execute = executor.execute

    def timed_execute(sched):
        start = time.perf_counter()
        out = execute(sched)
        forward_times.append(time.perf_counter() - start)
        return out

    executor.execute = timed_execute
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    print(f"{'batch':>5} {'step ms':>9} {'execute ms':>11} {'overhead ms':>12} {'overhead %':>11}")
    for batch in map(int, args.batch_sizes.split(",")):
        params = SamplingParams(temperature=0, max_tokens=args.steps + 10, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", list(range(100, 100 + args.prompt_len)), params)
        while len(engine.core.scheduler.running) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running
        ):
            engine.step()  # prefill everyone first
        steps, forward_times[:] = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        step, fwd = statistics.median(steps) * 1e3, statistics.median(forward_times) * 1e3
        print(f"{batch:>5} {step:>9.2f} {fwd:>11.2f} {step - fwd:>12.2f} {100 * (step - fwd) / step:>10.1f}%")
        for i in range(batch):
            engine.abort_request(f"{batch}-{i}")


if __name__ == "__main__":
    main()
