"""What prompt logprobs cost, and that only requests asking for them pay (in-process engine).

Each run prefills --prompts random prompts of --prompt-len tokens (max_tokens 1): without prompt
logprobs, with them for every request, for half of them, and again with the prompts already in the
prefix cache (a request that asks recomputes its prompt; one that does not is served from the cache).
Runs alternate, --repeats times; medians, and each against the run without prompt logprobs.

    .venv/bin/python benchmarks/bench_prompt_logprobs.py [--model smollm2-135m-instruct] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams

PLAIN, ASKS = (
    SamplingParams(max_tokens=1, temperature=0),
    SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
)
RUNS = {  # name -> (params per request given the count, prompts cached beforehand)
    "none": (lambda n: [PLAIN] * n, False),
    "all ask": (lambda n: [ASKS] * n, False),
    "half ask": (lambda n: [ASKS, PLAIN] * (n // 2), False),
    "none, cached": (lambda n: [PLAIN] * n, True),
    "all ask, cached": (lambda n: [ASKS] * n, True),
}


def one_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], cached: bool) -> float:
    llm.engine.core.reset_prefix_cache()
    if cached:
        llm.generate(prompts, PLAIN, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model alias, .gguf file or HF directory (default: %(default)s)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="prompts per run (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each kind; medians reported (default: %(default)s)")
    args = ap.parse_args()
    llm = LLM(model=args.model, num_kv_blocks=2 * args.prompts * (args.prompt_len // 16 + 2))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    one_run(llm, prompts, [PLAIN] * len(prompts), False)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(args.repeats):
        for name, (params, cached) in RUNS.items():
            times[name].append(one_run(llm, prompts, params(len(prompts)), cached))
    base = statistics.median(times["none"])
    tokens = args.prompts * args.prompt_len
    print(
        f"# {args.model}: {args.prompts} prompts x {args.prompt_len} tokens, max_tokens 1; "
        f"medians of {args.repeats} alternating runs"
    )
    print(f"{'run':<18} {'seconds':>8} {'prompt tok/s':>13} {'vs none':>8}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<18} {t:>8.3f} {tokens / t:>13.0f} {t / base:>7.2f}x")


if __name__ == "__main__":
    main()
