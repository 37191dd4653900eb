"""Where a serving step's time goes: the serving workload (16 requests of 200 random prompt tokens, 128
output tokens, all at once) driven in-process with the server's defaults, timed, and with --profile
the time per kernel and Python function (cProfile: the C++ kernels are built-in calls, so each shows
on its own line: the int8 GEMM `block_quant_matmul_q8_panels`, the compiled decode step
`DecodeStep.run`, torch's `scaled_dot_product_attention` for prompt chunks, ...).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serving_steps.py [--output-len 128] [--profile]

On a shared machine pin it to one CPU (`taskset -c 0`, the runner then takes one thread): with two
threads on an oversubscribed host every OpenMP fork/join waits for a descheduled thread, and the
profile measures that instead of the kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="a GGUF path or a model name (default: %(default)s)"
    )
    ap.add_argument("--requests", type=int, default=16, help="requests submitted at once (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=200, help="random prompt tokens each (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated each (default: %(default)s)")
    ap.add_argument("--profile", action="store_true", help="print the 20 functions with the most own time")
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    llm = LLM(model=args.model)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]} for _ in range(args.requests)
    ]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    print(f"{args.requests * args.output_len / elapsed:.1f} output tok/s ({elapsed:.2f} s)")


if __name__ == "__main__":
    main()
