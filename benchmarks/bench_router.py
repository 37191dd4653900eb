"""Data parallelism: what cache-aware routing buys. Starts --replicas replicas of a model (each pinned to
its share of the cores, one thread each on a 2-core machine), then for each policy a `tokenmill router`
in front of them, and drives it with `tokenmill bench serve` (shared-prefix workload by default: a few
long system prompts shared by many short questions). Between policies every replica's prefix cache is
emptied. Reports per policy the prefix-cache hit rate over all replicas (sum of their hits / queries
deltas on /metrics), output throughput, TTFT p50/p90 and how the requests were spread, as a markdown
table.

The replicas' KV caches are kept small (--num-kv-blocks) so that, as on a loaded server, one replica
cannot hold every shared prefix: with affinity each replica holds its share of them.

    .venv/bin/python benchmarks/bench_router.py --num-prompts 48 --num-prefixes 8 --prefix-len 384
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.bench import prometheus
from tokenmill.bench.cli import main as bench_main
from tokenmill.loader.source import DEFAULT_MODEL
from tokenmill.router.launcher import LocalReplicas, free_ports


def counters(url: str) -> tuple[float, float]:
    samples = prometheus.scrape(f"{url}/metrics")
    return (
        prometheus.metric_value(samples, prometheus.PREFIX_QUERIES) or 0.0,
        prometheus.metric_value(samples, prometheus.PREFIX_HITS) or 0.0,
    )


def routed(router_url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for s in prometheus.scrape(f"{router_url}/metrics") or []:
        if s.name == "tokenmill:router_requests_total":
            counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return counts


def start_front(cmd: list[str], url: str, log_path: Path) -> subprocess.Popen:
    """Start `cmd` (an HTTP front: a router, a proxy) logging to `log_path`; return once `url`/health is 200."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{cmd[3]} did not start; see {log_path}")
        time.sleep(0.2)


def start_router(urls: list[str], policy: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "router",
        *[a for u in urls for a in ("--replica", u)],
        "--policy",
        policy,
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    return start_front(cmd, url, log_dir / f"router-{policy}.log"), url


def run_policy(policy: str, replicas: LocalReplicas, args, log_dir: Path) -> dict:
    for url in replicas.urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
    router, router_url = start_router(replicas.urls, policy, log_dir)
    try:
        before = [counters(u) for u in replicas.urls]
        result_file = log_dir / f"bench-{policy}.json"
        bench_main(
            [
                "serve",
                "--base-url",
                router_url,
                "--model",
                args.model,
                "--tokenizer",
                args.model,
                "--dataset",
                args.dataset,
                "--num-prompts",
                str(args.num_prompts),
                "--num-prefixes",
                str(args.num_prefixes),
                "--prefix-len",
                str(args.prefix_len),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--num-turns",
                str(args.num_turns),
                "--max-concurrency",
                str(args.max_concurrency),
                "--ignore-eos",
                "--disable-tqdm",
                "--label",
                policy,
                "--result-file",
                str(result_file),
            ]
        )
        after = [counters(u) for u in replicas.urls]
        spread = routed(router_url)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
    summary = json.loads(result_file.read_text())["summary"]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "policy": policy,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "hit_rate": hits / queries if queries else 0.0,
        "output_throughput": summary["output_throughput"],
        "ttft_p50": summary["ttft_ms"]["median"],
        "ttft_p90": summary["ttft_ms"]["p90"],
        "duration": summary["duration_s"],
        "spread": [int(spread.get(u, 0)) for u in replicas.urls],
    }


def table(rows: list[dict]) -> str:
    header = (
        "| policy | requests (failed) | prefix-cache hit rate | output tok/s | TTFT p50 ms | TTFT p90 ms | "
        "requests per replica | duration s |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['completed']} ({r['failed']}) | {r['hit_rate']:.1%} | "
            f"{r['output_throughput']:.1f} | {r['ttft_p50']:.0f} | {r['ttft_p90']:.0f} | "
            f"{' / '.join(map(str, r['spread']))} | {r['duration']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model of every replica (default: %(default)s)")
    ap.add_argument(
        "--replicas", type=int, default=2, help="tokenmill serve processes behind the router (default: %(default)s)"
    )
    ap.add_argument(
        "--policies",
        default="prefix,round-robin",
        help="`tokenmill router --policy` values to compare, comma-separated (default: %(default)s)",
    )
    ap.add_argument(
        "--dataset",
        default="shared-prefix",
        choices=["shared-prefix", "multi-turn"],
        help="bench workload (default: %(default)s)",
    )
    ap.add_argument(
        "--num-prompts", type=int, default=48, help="requests (conversations) per policy (default: %(default)s)"
    )
    ap.add_argument(
        "--num-prefixes", type=int, default=8, help="shared-prefix: distinct system prompts (default: %(default)s)"
    )
    ap.add_argument(
        "--prefix-len", type=int, default=384, help="shared-prefix: tokens per system prompt (default: %(default)s)"
    )
    ap.add_argument("--input-len", type=int, default=24, help="question (user turn) tokens (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per request (default: %(default)s)")
    ap.add_argument(
        "--num-turns", type=int, default=3, help="multi-turn: turns per conversation (default: %(default)s)"
    )
    ap.add_argument("--max-concurrency", type=int, default=4, help="clients in the closed loop (default: %(default)s)")
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=160,
        help="KV blocks (16 tokens) per replica: room for about half the prefixes (default: %(default)s)",
    )
    ap.add_argument("--log-dir", default=None, help="replica/router logs and bench results (default: a temp dir)")
    args = ap.parse_args()

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_router_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    replica_argv = [
        "--model",
        args.model,
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--log-interval",
        "0",
        "--disable-log-requests",
        "--shutdown-timeout",
        "5",
    ]
    replicas = LocalReplicas(replica_argv, args.replicas, log_dir=log_dir, env=dict(os.environ))
    print(f"# {args.replicas} replicas of {args.model} (cores {replicas.cpus}), logs in {log_dir}", flush=True)
    rows = []
    try:
        replicas.start().wait_healthy()
        for url in replicas.urls:  # warm up each engine outside the measurement
            httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
        for policy in args.policies.split(","):
            rows.append(run_policy(policy.strip(), replicas, args, log_dir))
            print(f"# {policy}: done in {rows[-1]['duration']:.1f} s", flush=True)
    finally:
        replicas.stop()
    print(
        f"\n{args.dataset}: {args.num_prompts} requests, {args.num_prefixes} prefixes x {args.prefix_len} tokens + "
        f"{args.input_len}-token questions, {args.output_len} output tokens, concurrency {args.max_concurrency}, "
        f"{args.num_kv_blocks} KV blocks per replica\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
