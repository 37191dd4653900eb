"""Concurrent requests that share one long prefix: time to the first token of all of them, against one
request alone, and the prompt tokens the engine computed (issue 43, item 3).

    .venv/bin/python benchmarks/bench_concurrent_prefix.py [--model smollm2-135m-instruct]
        [--prefix-tokens 2500] [--suffix-tokens 40] [--sessions 4] [--rounds 3] [-- extra LLM kwargs as k=v]

Agent sessions that start together resend one system prompt; unless the later ones wait for the blocks the
first is computing, each prefills the prefix itself. Each round runs one session alone, then `--sessions`
sessions submitted at once (distinct suffixes), each on a fresh engine (an empty prefix cache), and reports
the seconds from submission to the last session's first token and the prompt tokens computed (the sum
of scheduled tokens over the steps: a count, steady on a busy machine). Prints each round and the medians;
the goal is sessions/one <= 1.3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

CORPUS = Path(__file__).resolve().parents[1] / "tokenmill" / "eval" / "corpus.txt"


def prompts(tokenizer, prefix_tokens: int, suffix_tokens: int, sessions: int) -> list[list[int]]:
    text = CORPUS.read_text()
    ids = tokenizer.encode(text * (1 + 3 * (prefix_tokens + sessions * suffix_tokens) // max(1, len(text))))
    prefix = ids[:prefix_tokens]
    rest = ids[prefix_tokens:]
    return [prefix + rest[i * suffix_tokens : (i + 1) * suffix_tokens] for i in range(sessions)]


def first_tokens(llm: LLM, batch: list[list[int]]) -> tuple[float, int]:
    """Seconds until every request of `batch` (submitted at once) has its first token; prompt tokens computed."""
    engine = llm.engine
    scheduler = engine.core.scheduler
    schedule, computed = scheduler.schedule, 0

    def counting_schedule():
        nonlocal computed
        out = schedule()
        computed += sum(out.num_scheduled_tokens.values())
        return out

    scheduler.schedule = counting_schedule
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.monotonic()
    for i, ids in enumerate(batch):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.monotonic() - t0, computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the default model)")
    ap.add_argument(
        "--prefix-tokens", type=int, default=2500, help="tokens of the shared prefix (default: %(default)s)"
    )
    ap.add_argument(
        "--suffix-tokens", type=int, default=40, help="tokens each session adds after it (default: %(default)s)"
    )
    ap.add_argument("--sessions", type=int, default=4, help="sessions submitted at once (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported) (default: %(default)s)")
    ap.add_argument("extra", nargs="*", help="extra LLM(...) keyword arguments as key=value (ints parsed)")
    args = ap.parse_args()
    kwargs = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (e.split("=", 1) for e in args.extra)}
    if args.model:
        kwargs["model"] = args.model
    one, many = [], []
    for r in range(args.rounds):
        row = []
        for n, out in ((1, one), (args.sessions, many)):
            with LLM(**kwargs) as llm:
                batch = prompts(llm.get_tokenizer(), args.prefix_tokens, args.suffix_tokens, n)
                seconds, computed = first_tokens(llm, batch)
            out.append(seconds)
            row.append(f"{n} session(s): {seconds:.2f} s, {computed} prompt tokens computed")
        print(f"round {r + 1}: " + "; ".join(row), flush=True)
    a, b = statistics.median(one), statistics.median(many)
    print(f"median: one {a:.2f} s, {args.sessions} at once {b:.2f} s, ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
