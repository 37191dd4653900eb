"""Disaggregated prefill/decode vs colocated serving under a mixed workload: most requests a short
prompt and --output-len tokens out, --long-fraction of them a --long-len-token prompt, Poisson
arrivals at --request-rate. Long prefills stall the decodes they share steps with on a colocated
server; with P/D the decode server only ever runs decodes (and one recomputed token per prompt).

Modes: `colocated` (one `tokenmill serve` on every core) and `pd-<connector>` (a `--kv-role producer` and
a `--kv-role consumer` server, each pinned to half the cores, behind `tokenmill disagg-proxy`). Each is
driven by `tokenmill bench serve` (the long-context dataset) with the same seed. Reports TTFT and ITL
p50/p95/p99 per mode, and for P/D the KV bytes and transfer time per request (the consumer's
/metrics: from asking for a prompt's KV to having it in its blocks; the producer's: copying it out).

    .venv/bin/python benchmarks/bench_disaggregated.py --num-prompts 100 --request-rate 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_router import start_front  # benchmarks/ is on sys.path when a script in it runs

from tokenmill.bench import prometheus
from tokenmill.bench.cli import main as bench_main
from tokenmill.loader.source import DEFAULT_MODEL
from tokenmill.router.launcher import LocalReplicas, cpu_shares, free_ports

CONNECTORS = {"pd-torch": "TorchDistributedConnector", "pd-shm": "SharedMemoryConnector"}
TRANSFER_METRICS = (
    "tokenmill:kv_transfers_total",
    "tokenmill:kv_transfer_bytes_total",
    "tokenmill:kv_transfer_seconds_total",
)


def transfer_counters(url: str) -> list[float]:
    samples = prometheus.scrape(f"{url}/metrics")
    return [prometheus.metric_value(samples, (name,)) or 0.0 for name in TRANSFER_METRICS]


def one_server(argv: list[str], cpus: list[int] | None, log_dir: Path) -> LocalReplicas:
    """A `tokenmill serve` with `argv`, pinned to `cpus` (all of this process's cores when None)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    server = LocalReplicas(argv, 1, log_dir=log_dir)
    if cpus is not None:
        server.cpus = [cpus]
    return server.start()


def start_proxy(prefill: str, decode: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "disagg-proxy",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    return start_front(cmd, url, log_dir / "proxy.log"), url


def drive(url: str, mode: str, args, log_dir: Path) -> dict:
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=300).raise_for_status()
    result_file = log_dir / f"bench-{mode}.json"
    bench_main(
        [
            "serve",
            "--base-url",
            url,
            "--model",
            args.model,
            "--tokenizer",
            args.model,
            "--dataset",
            "long-context",
            "--num-prompts",
            str(args.num_prompts),
            "--random-input-len",
            str(args.short_len),
            "--random-output-len",
            str(args.output_len),
            "--long-context-len",
            str(args.long_len),
            "--long-context-fraction",
            str(args.long_fraction),
            "--request-rate",
            str(args.request_rate),
            "--seed",
            str(args.seed),
            "--ignore-eos",
            "--disable-tqdm",
            "--label",
            mode,
            "--result-file",
            str(result_file),
        ]
    )
    return json.loads(result_file.read_text())["summary"]


def run_mode(mode: str, args, log_dir: Path) -> dict:
    argv = [
        "--model",
        args.model,
        "--log-interval",
        "0",
        "--disable-log-requests",
        "--shutdown-timeout",
        "5",
        *args.server_args.split(),
    ]
    if mode == "colocated":
        server = one_server(argv, None, log_dir / mode)
        try:
            server.wait_healthy()
            return {"mode": mode, "summary": drive(server.urls[0], mode, args, log_dir)}
        finally:
            server.stop()
    config = json.dumps({"kv_connector": CONNECTORS[mode], "kv_port": free_ports(1)[0]})
    halves = cpu_shares(2)
    servers = [
        one_server([*argv, "--kv-role", role, "--kv-transfer-config", config], cpus, log_dir / f"{mode}-{role}")
        for role, cpus in zip(("producer", "consumer"), halves)
    ]
    proxy = None
    try:
        for s in servers:
            s.wait_healthy()
        proxy, url = start_proxy(servers[0].urls[0], servers[1].urls[0], log_dir / f"{mode}-consumer")
        before = [transfer_counters(s.urls[0]) for s in servers]
        summary = drive(url, mode, args, log_dir)
        after = [transfer_counters(s.urls[0]) for s in servers]
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in servers:
            s.stop()
    (p_n, p_bytes, p_s), (c_n, c_bytes, c_s) = ([a - b for a, b in zip(x, y)] for x, y in zip(after, before))
    return {
        "mode": mode,
        "summary": summary,
        "transfers": c_n,
        "kv_bytes_per_request": c_bytes / c_n if c_n else 0,
        "receive_ms_per_request": 1000 * c_s / c_n if c_n else 0,
        "send_ms_per_request": 1000 * p_s / p_n if p_n else 0,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | requests (failed) | TTFT p50 / p95 / p99 ms | ITL p50 / p95 / p99 ms | output tok/s | "
        "KV bytes / request | KV receive ms / request | KV send ms / request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["summary"]
        ttft, itl = (
            " / ".join(f"{s[k][p]:.0f}" if s[k][p] is not None else "-" for p in ("median", "p95", "p99"))
            for k in ("ttft_ms", "itl_ms")
        )
        kv = (
            (
                f"{r['kv_bytes_per_request'] / 2**20:.2f} MiB | {r['receive_ms_per_request']:.1f} | "
                f"{r['send_ms_per_request']:.1f}"
            )
            if "transfers" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['mode']} | {s['completed']} ({s['failed']}) | {ttft} | {itl} | {s['output_throughput']:.1f} | {kv} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model of every server (default: %(default)s)")
    ap.add_argument("--modes", default="colocated,pd-torch,pd-shm", help="comma-separated (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per mode (default: %(default)s)")
    ap.add_argument(
        "--request-rate", type=float, default=2.0, help="Poisson arrivals per second (default: %(default)s)"
    )
    ap.add_argument("--short-len", type=int, default=64, help="short prompts' tokens (default: %(default)s)")
    ap.add_argument("--long-len", type=int, default=1536, help="long prompts' tokens (default: %(default)s)")
    ap.add_argument("--long-fraction", type=float, default=0.1, help="share of long prompts (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="workload and arrivals seed (default: %(default)s)")
    ap.add_argument(
        "--server-args",
        default="",
        help="more `tokenmill serve` flags for every server, e.g. '--device cuda --dtype bfloat16' (default: none)",
    )
    ap.add_argument("--log-dir", default=None, help="server logs and bench results (default: a temp dir)")
    args = ap.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_disaggregated_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"# logs in {log_dir}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        rows.append(run_mode(mode.strip(), args, log_dir))
        print(f"# {mode}: done in {rows[-1]['summary']['duration_s']:.1f} s", flush=True)
    print(
        f"\n{args.model}: {args.num_prompts} requests at {args.request_rate:g}/s (Poisson), {args.long_fraction:.0%} with "
        f"{args.long_len}-token prompts, the rest {args.short_len}; {args.output_len} output tokens each\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
