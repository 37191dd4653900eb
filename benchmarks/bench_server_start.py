"""Seconds from launching `tokenmill serve` to a healthy `/health`, optionally against an earlier git
revision in the same run (the two taking turns, round by round).

    .venv/bin/python benchmarks/bench_server_start.py [--model smollm2-135m-instruct] [--rounds 3]
        [--against REV] [-- extra serve flags]

Each start is a fresh process (`python -m tokenmill.server.cli serve` on a free port, run from the
tree's own directory so that its code is imported), polled every 0.1 s, then stopped with SIGTERM.
The model-load seconds are read from the server's own log line. `--against REV`: a git worktree of
REV with its own kernel build (built before the first timed round). Prints each round and the medians.
"""

from __future__ import annotations

import argparse
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


def start_once(tree: Path, model: str, extra: list[str]) -> tuple[float, float | None]:
    """(seconds to a healthy /health, the model-load seconds the server logged)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    if tree != ROOT:
        env["TORCH_EXTENSIONS_DIR"] = str(tree / ".kernels")
    cmd = [sys.executable, "-m", "tokenmill.server.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *extra]
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
    finally:
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
    loaded = re.search(r"loaded in ([0-9.]+) s", log)
    return ready, float(loaded.group(1)) if loaded else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model to serve (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed starts per tree (default: %(default)s)")
    ap.add_argument("--against", metavar="REV", help="also time git revision REV, taking turns")
    ap.add_argument("extra", nargs="*", help="more `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    if args.against:
        trees[args.against] = Path(tempfile.mkdtemp(prefix="tokenmill-start-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(trees[args.against]), args.against], cwd=ROOT,
                       check=True, capture_output=True)
    try:
        for tree in trees.values():  # untimed: builds the kernels, warms the page cache
            start_once(tree, args.model, args.extra)
        times: dict[str, list[tuple[float, float | None]]] = {label: [] for label in trees}
        for r in range(args.rounds):
            for label, tree in trees.items():
                times[label].append(start_once(tree, args.model, args.extra))
                ready, loaded = times[label][-1]
                print(f"round {r + 1}  {label:12s} ready {ready:6.2f} s  model loaded in {loaded} s", flush=True)
        for label, runs in times.items():
            print(f"median {label:12s} ready {statistics.median(t for t, _ in runs):6.2f} s")
    finally:
        if args.against:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees[args.against])], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
