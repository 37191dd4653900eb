"""CPU instructions per engine step, counted by valgrind (callgrind): repeatable on a noisy, shared
machine where wall-clock times of the same code move by 10-30% between runs.

    .venv/bin/python benchmarks/bench_step_instructions.py [--batch 1] [--steps 30]
    PYTHONPATH=/path/to/other/tree .venv/bin/python benchmarks/bench_step_instructions.py   # another tree

The model is loaded and warmed up with instrumentation off; counting is switched on
(`callgrind_control -i on`) for exactly --steps decode steps of --batch requests, on one thread.
Needs valgrind (Debian: `apt-get install valgrind`). Slow: the load alone runs ~15x slower under
valgrind (about 15 minutes for the default model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    """Runs under valgrind: load, warm up, then exactly --steps steps between the flag's two states."""
    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(1)
    engine = LLM(model=args.model, num_kv_blocks=256).engine
    torch.set_num_threads(1)
    for i in range(args.batch):
        prompt = list(range(100 + i, 100 + i + args.prompt_len))
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True))
    for _ in range(20):
        engine.step()
    flag = Path(args.flag)
    print("READY", flush=True)
    while not flag.exists():
        time.sleep(0.2)
    for _ in range(args.steps):
        engine.step()
    print("DONE", flush=True)
    while flag.exists():
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps counted (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--flag", help=argparse.SUPPRESS)  # set in the worker process
    args = ap.parse_args()
    if args.flag:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        flag, out = Path(tmp) / "flag", Path(tmp) / "callgrind.out"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--prompt-len",
                str(args.prompt_len),
                "--flag",
                str(flag),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert proc.stdout.readline().strip() == "READY", "the worker failed before it was ready"
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        flag.touch()
        assert proc.stdout.readline().strip() == "DONE", "the worker failed while stepping"
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
        flag.unlink()
        proc.wait()
        totals = subprocess.run(["callgrind_annotate", str(out)], capture_output=True, text=True).stdout
    total = int(next(line for line in totals.splitlines() if "PROGRAM TOTALS" in line).split()[0].replace(",", ""))
    print(
        f"batch {args.batch}: {total:,} instructions in {args.steps} steps = {total / args.steps / 1e6:.1f} M per step"
    )


if __name__ == "__main__":
    main()
