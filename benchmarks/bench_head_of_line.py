"""A short request that arrives while a long prompt prefills: its time to the first token and to its last
(8 tokens: the decodes beside the prompt's chunks), with the long prompt's chunks held to
`--long-prefill-share` of the step budget (default 0.5) against the share off (1), and what that costs the
long prompt's own first token.

    .venv/bin/python benchmarks/bench_head_of_line.py [--model smollm2-135m-instruct] [--long-tokens 6000]
        [--short-tokens 16] [--rounds 3] [--shares 1,0.5]

Each round and share runs a fresh engine: the long prompt is submitted and runs one step, then the short
one is submitted; steps run until the long one has its first token and the short one all of its own.
Prints each round's seconds (the short request's TTFT and end, from its submission; the long TTFT) and
the medians per share, taking turns between the shares.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

SHORT_OUTPUT = 8  # the short request's tokens

CORPUS = Path(__file__).resolve().parents[1] / "tokenmill" / "eval" / "corpus.txt"


def first_tokens(llm: LLM, long_ids: list[int], short_ids: list[int]) -> tuple[float, float, float]:
    """(seconds from the short request's submission to its first token and to its last, the long one's TTFT)."""
    engine = llm.engine
    t0 = time.monotonic()
    engine.add_request("long", long_ids, SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()  # the long prompt's first chunk
    t1 = time.monotonic()
    engine.add_request("short", short_ids, SamplingParams(max_tokens=SHORT_OUTPUT, temperature=0.0, ignore_eos=True))
    first: dict[str, float] = {}
    end = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic()
            if out.request_id == "short" and out.finished:
                end = time.monotonic()
    return first["short"] - t1, end - t1, first["long"] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the default model)")
    ap.add_argument("--long-tokens", type=int, default=6000, help="the long prompt's tokens (default: %(default)s)")
    ap.add_argument("--short-tokens", type=int, default=16, help="the short prompt's tokens (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported (default: %(default)s)")
    ap.add_argument("--shares", default="1,0.5", help="--long-prefill-share values, in turn (default: %(default)s)")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    kwargs = {"model": args.model} if args.model else {}
    results: dict[float, list[tuple[float, float, float]]] = {s: [] for s in shares}
    for r in range(args.rounds):
        for share in shares:
            with LLM(long_prefill_share=share, max_model_len=args.long_tokens + 64, **kwargs) as llm:
                ids = llm.get_tokenizer().encode(CORPUS.read_text())
                ids = ids * (1 + (args.long_tokens + args.short_tokens) // len(ids))
                row = first_tokens(llm, ids[: args.long_tokens], ids[-args.short_tokens :])
            results[share].append(row)
            print(f"round {r + 1} share {share:g}: " + describe(row), flush=True)
    for share, rows in results.items():
        print(f"median share {share:g}: " + describe(tuple(statistics.median(x) for x in zip(*rows))))


def describe(row: tuple[float, ...]) -> str:
    short_first, short_end, long_first = row
    return f"short TTFT {short_first:.2f} s, short done {short_end:.2f} s, long TTFT {long_first:.2f} s"


if __name__ == "__main__":
    main()
