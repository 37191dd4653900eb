"""The compiled decode step of two builds of the CPU kernels in one process, taking turns call by call
on one real step's inputs (SmolLM2 by default, after a 512-token prompt and 63 decode steps): the
median time of each and their ratio, and how far the two results differ (0: the same bits); --batch N
times a step of N decodes (as a server's batch) instead of one. On a shared machine this
is steadier than two processes in turn; at one thread it times the engine thread's CPU, not the wall.

    PYTHONPATH=TREE .venv/bin/python benchmarks/ab_decode_step.py BASE_SO [--threads 1] [--seconds 20]

BASE_SO: the other build's extension module file (e.g. a checkout's tokenmill/kernels/_cpu_*.so, built
from its sources, or another -march's build of these; one with this tree's `DecodeStep` interface);
TREE's own build is the one `tokenmill.kernels.cpu_kernels()` loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels, decode_step


def load_module(path: str):
    """The extension module in `path` (its init function is named after the file's first part)."""
    name = re.sub(r"\..*", "", Path(path).name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the other build's extension module file (.so)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timed calls (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the two take turns (default: %(default)s)")
    ap.add_argument(
        "--batch", type=int, default=1, help="requests decoding together: the step's rows (default: %(default)s)"
    )
    args = ap.parse_args()
    base, new = load_module(args.base), cpu_kernels()
    llm = LLM(args.model)
    captured = {}
    call = decode_step.CompiledDecode.__call__

    def capture(step, *a, **k):  # the step with the most decodes (and no prompt chunk)
        rows, decodes_only = a[1].shape[0], not a[3][0].prefills
        if decodes_only and rows >= captured.get("rows", 0):
            captured.update(step=(step, a), rows=rows)
        return call(step, *a, **k)

    decode_step.CompiledDecode.__call__ = capture
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(1000 + r, 1512 + r))} for r in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # the last step: a decode of each
    decode_step.CompiledDecode.__call__ = call
    step, (positions, hidden, residual, metas, *_) = captured["step"]
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def runner(module):  # a build's step, built once with the step's weights
        experts = step.experts if "arg9" in module.DecodeStep.__init__.__doc__ else ()  # builds before MoE: none
        ints = step.ints if experts else [i for n, i in enumerate(step.ints) if n % 17 != 16]  # nor its index
        return module.DecodeStep(
            step.tensors, ints, step.num_heads, step.num_kv_heads, step.head_dim, step.eps, step.scale,
            step.soft_caps, step.lora, *experts,
        )  # fmt: skip

    steps = {base: runner(base), new: runner(new)}

    def run(module):  # a fresh copy of the stream each call: the step adds to it in place
        fresh = None if residual is None else residual.clone()
        args = step.run_args(positions, hidden.clone(), fresh, metas)
        doc = module.DecodeStep.run.__doc__
        if "arg13" not in doc:  # a build from before MoE layers: no expert counting
            args = args[:13]
        if "arg12" not in doc:  # a build from before chunk tables per group (one list fewer)
            args = args[:11] + args[12:]
        return steps[module].run(*args)

    a, b = run(base), run(new)
    differ = max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(a, b))  # 0: the same bits
    times = {base: [], new: []}
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for module in (base, new):
            start = clock()
            run(module)
            times[module].append(clock() - start)
    old, now = (statistics.median(times[m]) * 1e3 for m in (base, new))
    print(f"STEP threads {args.threads}, {hidden.shape[0]} rows: base {old:.3f} ms, this tree {now:.3f} ms, base/this {old / now:.3f} "
          f"({len(times[new])} calls each, results differ by at most {differ:.3g} of the largest)")  # fmt: skip


if __name__ == "__main__":
    main()
