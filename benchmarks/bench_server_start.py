"""Seconds from launching `tokenmill serve` to a healthy `/health`, and the first request's latency after
that (a readiness that left work for later shows there), optionally against an earlier git revision in
the same run (the two taking turns, round by round).

    .venv/bin/python benchmarks/bench_server_start.py [--model smollm2-135m-instruct] [--rounds 3]
        [--against REV] [-- extra serve flags]

Each start is a fresh process (`python -m tokenmill.server.cli serve` on a free port, run from the
tree's own directory so that its code is imported), polled every 0.1 s; then one completion (4 tokens)
is timed, and the server is stopped with SIGTERM. Also reported: the CPU seconds its processes had used
when it became ready (Linux; steadier than wall time on a shared machine) and the model-load seconds
from the server's own log line. `--against REV`: a git worktree of REV, with its own kernel build when
its kernel sources differ from this tree's (built before the first timed round). Prints each round and
the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` and its descendants (None where /proc is missing)."""
    tick, children, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(p)
        cpu[p] = sum(int(f) for f in fields[11:15]) / tick  # utime, stime, and its reaped children's
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


def first_request_seconds(port: int, model: str) -> float:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as r:
        r.read()
    return time.monotonic() - t0


def start_once(tree: Path, model: str, extra: list[str], kernels: Path | None) -> dict:
    """Seconds to a healthy /health (`ready`), the CPU seconds used by then (`cpu`), the first request's
    seconds (`first`), the model-load seconds the server logged (`loaded`)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    if kernels is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(kernels)
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.server.cli",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited during startup:\n{proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        ready = time.monotonic() - t0
        cpu = tree_cpu_seconds(proc.pid)
        first = first_request_seconds(port, model)
    finally:
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
    loaded = re.search(r"loaded in ([0-9.]+) s", log)
    return {"ready": ready, "cpu": cpu, "first": first, "loaded": float(loaded.group(1)) if loaded else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model to serve (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed starts per tree (default: %(default)s)")
    ap.add_argument("--against", metavar="REV", help="also time git revision REV, taking turns")
    ap.add_argument("extra", nargs="*", help="more `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    kernels: dict[str, Path | None] = {"this tree": None}
    if args.against:
        trees[args.against] = Path(tempfile.mkdtemp(prefix="tokenmill-start-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(trees[args.against]), args.against],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        same = (
            subprocess.run(
                ["git", "diff", "--quiet", args.against, "--", "tokenmill/kernels", "csrc"], cwd=ROOT, check=False
            ).returncode
            == 0
        )
        kernels[args.against] = None if same else trees[args.against] / ".kernels"
    try:
        for label, tree in trees.items():  # untimed: builds the kernels, warms the page cache
            start_once(tree, args.model, args.extra, kernels[label])
        runs: dict[str, list[dict]] = {label: [] for label in trees}
        for r in range(args.rounds):
            for label, tree in trees.items():
                run = start_once(tree, args.model, args.extra, kernels[label])
                runs[label].append(run)
                cpu = "?" if run["cpu"] is None else f"{run['cpu']:.2f}"
                print(
                    f"round {r + 1}  {label:12s} ready {run['ready']:6.2f} s ({cpu} CPU s)  first request "
                    f"{run['first']:5.2f} s  model loaded in {run['loaded']} s",
                    flush=True,
                )
        for label, rs in runs.items():
            cpus = [r["cpu"] for r in rs if r["cpu"] is not None]
            cpu = f" ({statistics.median(cpus):.2f} CPU s)" if cpus else ""
            print(
                f"median {label:12s} ready {statistics.median(r['ready'] for r in rs):6.2f} s{cpu}  first request "
                f"{statistics.median(r['first'] for r in rs):5.2f} s"
            )
    finally:
        if args.against:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees[args.against])], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
