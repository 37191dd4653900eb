"""llama-server's answer to a restart, beside `bench_kv_tiers.py restart`: the same long prompt (the same
token ids) cold, then the slot saved to disk (`--slot-save-path`, `POST /slots/0?action=save`), the server
stopped, a new one started, the slot restored (`?action=restore`) and the prompt sent again.

    .venv/bin/python benchmarks/peers/llama_slot_restore.py [--model qwen2.5-coder-0.5b] [--tokens 6000]

llama.cpp restores a slot only on request, by file name, into one slot; tokenmill's tier finds every stored
prefix by its key without being told. The time "from disk" here is the restore plus the request.
Needs benchmarks/peers/build_llama_cpp.sh's llama-server.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SERVER = next(HERE.glob("build/llama.cpp-b*/bin/llama-server"), None)


def start(model: str, port: int, slots: Path, threads: int) -> subprocess.Popen:
    cmd = [str(SERVER), "-m", model, "--port", str(port), "-c", "8192", "-np", "1", "-t", str(threads)]
    proc = subprocess.Popen(
        [*cmd, "--slot-save-path", f"{slots}/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)


def timed(method: str, url: str, body: dict) -> tuple[float, dict]:
    began = time.perf_counter()
    r = httpx.request(method, url, json=body, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - began, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="qwen2.5-coder-0.5b",
        help="a name for ../shared/models/fetch.sh, or a GGUF path (default: %(default)s)",
    )
    ap.add_argument(
        "--tokens", type=int, default=6000, help="prompt length in tokens (random ids) (default: %(default)s)"
    )
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads (-t) (default: %(default)s)")
    ap.add_argument(
        "--port", type=int, default=8472, help="port llama-server listens on at 127.0.0.1 (default: %(default)s)"
    )
    args = ap.parse_args()
    if SERVER is None:
        raise SystemExit("no llama-server: run benchmarks/peers/build_llama_cpp.sh first")
    model = args.model
    if not Path(model).is_file():
        fetch = HERE.parents[2] / "shared" / "models" / "fetch.sh"
        model = subprocess.run(["bash", str(fetch), model], capture_output=True, text=True, check=True).stdout.strip()
    prompt = random.Random(0).choices(range(200, 20000), k=args.tokens)  # as bench_kv_tiers.py restart
    request = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True}
    base = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as slots:
        server = start(model, args.port, Path(slots), args.threads)
        cold, first = timed("POST", f"{base}/completion", request)
        saved, _ = timed("POST", f"{base}/slots/0?action=save", {"filename": "prompt.bin"})
        server.terminate()
        server.wait()
        size = (Path(slots) / "prompt.bin").stat().st_size
        server = start(model, args.port, Path(slots), args.threads)
        restored, _ = timed("POST", f"{base}/slots/0?action=restore", {"filename": "prompt.bin"})
        warm, again = timed("POST", f"{base}/completion", request)
        server.terminate()
        server.wait()
    print(
        f"llama-server {SERVER.parent.parent.name}, {Path(model).name}, prompt {args.tokens} tokens, {args.threads} threads"
    )
    print(
        f"TTFT cold {cold:.2f} s; slot saved in {saved:.3f} s ({size / 2**20:.1f} MiB); after a restart: restore "
        f"{restored:.3f} s + request {warm:.3f} s = {restored + warm:.3f} s, {cold / (restored + warm):.1f}x lower; "
        f"same text: {first['content'] == again['content']}; tokens evaluated after the restore: "
        f"{again.get('timings', {}).get('prompt_n')}"
    )


if __name__ == "__main__":
    main()
