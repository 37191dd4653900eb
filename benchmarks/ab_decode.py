"""Single-stream decode of the tokenmill tree this Python imports: 128 tokens after a 512-token prompt,
the median of 5 runs (after one untimed), the prefix cache reset before each.

    PYTHONPATH=TREE .venv/bin/python benchmarks/ab_decode.py LABEL [--model smollm2-135m-instruct]

Run it for two trees in turn (`benchmarks/ab_against.sh` does) to compare them in one session.
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label", help="what to call this tree in the output line")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt length in tokens (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs after a warm-up run (default: %(default)s)")
    args = ap.parse_args()
    llm = LLM(args.model)
    prompt = list(range(1000, 1000 + args.prompt_len))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rates = []
    for i in range(args.repeats + 1):
        llm.engine.core.reset_prefix_cache()
        times = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].metrics.token_times
        if i:  # the first run is a warm-up
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    print(f"DECODE {args.label} {statistics.median(rates):.1f} tok/s  runs {[round(r, 1) for r in rates]}")


if __name__ == "__main__":
    main()
