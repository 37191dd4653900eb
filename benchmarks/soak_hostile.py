"""Soak with hostile requests mixed in: the innocent traffic's goodput and p99 TTFT with a share of
hostile requests (default 5%) against the same soak with none.

    .venv/bin/python benchmarks/soak_hostile.py [--clients 6] [--phase-seconds 40] [--phases 4]

One `tokenmill serve` (the default model). `--clients` threads send back to back; in the hostile
phases each request is, with probability `--hostile`, one of HOSTILE instead of an innocent one:
bad numbers and token ids, unsatisfiable constraints, bodies no parser should take, a stream
abandoned after its first chunk. Clean and hostile phases alternate (clean first), so drifts of a
shared machine fall on both. Innocent requests are streamed completions (greedy, 16 tokens); one is
good if it ends with a finish reason and no error. Reported per kind of phase: innocent requests
sent and failed, goodput (good innocent requests per second), median and p99 TTFT, and the hostile
requests answered with a 5xx (the goal: none; no innocent request fails; p99 within 10%).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
DEAD = "[^\\s\\S]"  # a regex nothing matches
DEAD_SCHEMA = {"$ref": "#"}  # a schema that is only a $ref to itself


def _completion(**extra) -> dict:
    return {"prompt": "Hello", "max_tokens": 8, "temperature": 0, **extra}


# name -> (path, JSON body or raw bytes); each answered with a 4xx, or (the abandoned stream) dropped
HOSTILE = {
    "seed overflow with n": ("/v1/completions", _completion(n=2, seed=2**64 - 1, temperature=1.0)),
    "logit_bias key not an int": ("/v1/completions", _completion(logit_bias={"²": 1})),
    "empty-language regex": ("/v1/completions", _completion(structured_outputs={"regex": DEAD})),
    "self-referencing schema": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": DEAD_SCHEMA}},
        },
    ),
    "token ids outside the vocabulary": ("/v1/completions", _completion(prompt=[10**9, 5])),
    "max_tokens past the context": ("/v1/completions", _completion(max_tokens=10**9)),
    "deeply nested JSON": ("/v1/completions", b'{"prompt": ' * 100_000),
    "invalid JSON": ("/v1/completions", b"{not json"),
    "abandoned stream": ("/v1/completions", _completion(max_tokens=200, ignore_eos=True, stream=True)),
}


def start_server(model: str, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    from tokenmill.router.launcher import free_ports

    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "tokenmill.server.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--log-interval", "0", "--disable-log-requests", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start; see {log}")
        time.sleep(0.5)


def innocent(client: httpx.Client, model: str, rng: random.Random) -> tuple[bool, float | None]:
    """One streamed completion: (good, TTFT in seconds)."""
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": 16, "temperature": 0, "stream": True}
    start, ttft, finish = time.perf_counter(), None, None
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, None
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return False, ttft
                choice = event["choices"][0]
                if ttft is None and choice.get("text"):
                    ttft = time.perf_counter() - start
                finish = choice.get("finish_reason") or finish
    except httpx.HTTPError:
        return False, ttft
    return finish is not None and ttft is not None, ttft


def hostile(client: httpx.Client, model: str, name: str) -> int:
    """Send one hostile request; its status (0: dropped by us on purpose)."""
    path, body = HOSTILE[name]
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"}).status_code
    body = {"model": model, **body}
    if body.get("stream"):
        with client.stream("POST", path, json=body) as r:
            for _ in r.iter_lines():
                return 0  # gone after the first chunk
            return r.status_code
    return client.post(path, json=body).status_code


def run_phase(url: str, model: str, clients: int, seconds: float, share: float, seed: int) -> dict:
    results = {"good": 0, "failed": 0, "ttft": [], "hostile": 0, "hostile_5xx": 0}
    lock, end = threading.Lock(), time.monotonic() + seconds

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        with httpx.Client(base_url=url, timeout=300) as client:
            while time.monotonic() < end:
                if rng.random() < share:
                    status = hostile(client, model, rng.choice(list(HOSTILE)))
                    with lock:
                        results["hostile"] += 1
                        results["hostile_5xx"] += status >= 500
                    continue
                good, ttft = innocent(client, model, rng)
                with lock:
                    results["good" if good else "failed"] += 1
                    if good:
                        results["ttft"].append(ttft)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results["seconds"] = seconds
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model the server loads (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=6, help="client threads sending back to back (default: %(default)s)")
    ap.add_argument(
        "--phase-seconds", type=float, default=40.0, help="length of each phase in seconds (default: %(default)s)"
    )
    ap.add_argument(
        "--phases",
        type=int,
        default=4,
        help="clean and hostile phases, alternating, clean first; an even number (default: %(default)s)",
    )
    ap.add_argument(
        "--hostile",
        type=float,
        default=0.05,
        help="share of hostile requests in the hostile phases, 0-1 (default: %(default)s)",
    )
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args()

    log = Path(tempfile.mkdtemp(prefix="soak-hostile-")) / "server.log"
    proc, url = start_server(args.model, log, args.serve_args)
    totals = {
        kind: {"good": 0, "failed": 0, "ttft": [], "hostile": 0, "hostile_5xx": 0, "seconds": 0.0} for kind in (0, 1)
    }
    try:
        for phase in range(args.phases):
            kind = phase % 2
            r = run_phase(url, args.model, args.clients, args.phase_seconds, args.hostile if kind else 0.0, phase)
            for key in totals[kind]:
                totals[kind][key] += r[key]
            print(
                f"phase {phase} ({'hostile' if kind else 'clean'}): {r['good']} good, {r['failed']} failed", flush=True
            )
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(60)
    print(
        f"# {args.model}, {args.clients} clients, {args.phases} phases of {args.phase_seconds:g} s, {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'traffic':>18} {'innocent':>9} {'failed':>7} {'goodput/s':>10} {'TTFT p50 ms':>12} {'p99 ms':>8} {'hostile':>8} {'5xx':>4}"
    )
    for kind, name in ((0, "clean"), (1, f"{args.hostile:.0%} hostile")):
        t = totals[kind]
        ttft = sorted(t["ttft"])
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan")
        print(
            f"{name:>18} {t['good'] + t['failed']:>9} {t['failed']:>7} {t['good'] / t['seconds']:>10.2f} "
            f"{statistics.median(ttft) * 1e3 if ttft else float('nan'):>12.0f} {p99 * 1e3:>8.0f} {t['hostile']:>8} {t['hostile_5xx']:>4}"
        )
    for line in metrics.splitlines():
        if line.startswith(("tokenmill:step_failures_total", "tokenmill:requests_failed_isolated_total")):
            print(line)
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
