"""What one client of the official OpenAI SDK sees from a running server: its connection pool keeps one
connection alive from request to request, as real clients do (`tokenmill bench serve` may open a
connection per request, and a connection's first exchange can hide delays the later ones pay).

    .venv/bin/python benchmarks/bench_client_latency.py --base-url http://127.0.0.1:8000 [--requests 8]

Each request in turn: a streamed completion (time to its first token, time between tokens), then a
non-streamed one; greedy, `ignore_eos`, so every request generates its full length. Prints medians
(and the p99 between tokens) over --requests requests of each kind.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="the server's root URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=8, help="requests of each kind (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a streamed request generates (default: %(default)s)")
    ap.add_argument(
        "--plain-tokens", type=int, default=8, help="tokens a non-streamed request generates (default: %(default)s)"
    )
    args = ap.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    greedy = {"model": model, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first, between, plain = [], [], []
    for i in range(args.requests):
        start, last = time.perf_counter(), None
        for _ in client.completions.create(prompt=f"Story {i}:", max_tokens=args.tokens, stream=True, **greedy):
            now = time.perf_counter()
            (first if last is None else between).append(now - (start if last is None else last))
            last = now
        start = time.perf_counter()
        client.completions.create(prompt=f"Question {i}:", max_tokens=args.plain_tokens, **greedy)
        plain.append(time.perf_counter() - start)
    p99 = sorted(between)[min(len(between) - 1, int(0.99 * len(between)))]
    print(
        f"streamed: first token {1e3 * statistics.median(first):.1f} ms, between tokens "
        f"{1e3 * statistics.median(between):.2f} ms (p99 {1e3 * p99:.1f}); "
        f"non-streamed, {args.plain_tokens} tokens: {1e3 * statistics.median(plain):.1f} ms"
    )


if __name__ == "__main__":
    main()
