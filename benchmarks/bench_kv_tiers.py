"""The KV cache's tiers (`serve --kv-cache-dir`, `--kv-offloading-size`), measured on real servers.

    .venv/bin/python benchmarks/bench_kv_tiers.py restart [--model qwen2.5-coder-0.5b] [--tokens 6000]
    .venv/bin/python benchmarks/bench_kv_tiers.py agent [--model smollm2-135m-instruct] [--sessions 3] [--turns 4]
        [--modes off,disk,ram,ram+disk,llama,llama-off] [--ram-mib 1024] [--llama-parallel 1]
    .venv/bin/python benchmarks/bench_kv_tiers.py minload [--model smollm2-135m-instruct] [--hits 16 64 512]

`restart`: a server with the tier answers a long prompt (token ids, `max_tokens` 1: the time is the
time to first token) cold, is stopped, and a new server on the same directory answers the same prompt
(from disk); then the tier's own counters: seconds loading (reading, verifying, copying into the pool)
and saving (the step loop's copy out of the pool; the writer thread's time apart) per block.

`agent`: several sessions at once, each turn resending a long shared system prompt plus its own growing
history (its earlier turns' prompts and answers) with a KV pool too small to keep every session's
prefix, once per `--modes` entry on a fresh server: tokenmill with no tier, the disk tier, the RAM tier
(`--kv-offloading-size`), both; and llama-server on the same GGUF and token ids with its host-RAM
prompt cache (`--cache-ram`, `llama`) or without (`llama-off`), its context (`-c`) the tokens of
tokenmill's pool. TTFT p50 / p90 of the turns after the first, the total time, and what each tier
supplied (llama-server: the prompt tokens it evaluated).

`minload`: in one process, TTFT with H prompt tokens on disk, loaded vs recomputed, for several H (what
`--kv-disk-min-load-tokens` is set from), and a block's load against a copy in RAM (a host-RAM tier).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_server_utils import ServerProcess, free_port, healthy, metric_values  # noqa: E402

PEERS = ROOT / "benchmarks" / "peers"


def start(log_dir: Path, model: str, *flags: str) -> tuple[ServerProcess, float]:
    began = time.perf_counter()
    srv = ServerProcess(log_dir, *flags)
    srv.args[1] = model  # ServerProcess starts the default model
    srv.start()
    return srv, time.perf_counter() - began


def ttft(srv: ServerProcess, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
    """Seconds to the first token (`max_tokens` 1: the whole request) and the tokens' text."""
    began = time.perf_counter()
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=3600,
    )
    r.raise_for_status()
    return time.perf_counter() - began, r.json()["choices"][0]["text"]


def tier(srv: ServerProcess, name: str = "disk") -> dict[str, float]:
    return {
        k.split("kv_tier_")[1].split("{")[0].removesuffix("_total"): v
        for k, v in metric_values(srv.url).items()
        if f'tier="{name}"' in k
    }


def written(srv: ServerProcess, cache: Path) -> dict[str, float]:
    """The disk tier's counters once its writer is done: the worker half reports them after a step, so
    wait until the block files stop appearing, then run a one-token step to carry the last report."""
    count, stable = -1, 0
    while stable < 4:  # unchanged over 2 s
        now = len(list(cache.glob("*.kv")))
        count, stable = now, (stable + 1 if now == count else 0)
        time.sleep(0.5)
    ttft(srv, [17, 18, 19], max_tokens=1)
    return tier(srv)


def restart(args) -> None:
    prompt = random.Random(0).choices(range(200, 20000), k=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        cache, flags = Path(tmp) / "kv", ("--kv-cache-dir", str(Path(tmp) / "kv"), "--max-model-len", "8192")
        first, started = start(Path(tmp), args.model, *flags)
        cold, text = ttft(first, prompt)
        saved = written(first, cache)
        first.stop()
        second, restarted = start(Path(tmp), args.model, *flags)
        warm, again = ttft(second, prompt)
        loaded = tier(second)
        second.stop()
        blocks = len(list(cache.glob("*.kv")))
        size = sum(p.stat().st_size for p in cache.glob("*.kv"))
    print(f"model {args.model}, prompt {args.tokens} tokens, start {started:.1f} s / restart {restarted:.1f} s")
    print(
        f"TTFT cold {cold:.2f} s, from disk after a restart {warm:.3f} s: {cold / warm:.1f}x lower; same text: {text == again}"
    )
    print(f"disk: {blocks} block files, {size / 2**20:.1f} MiB ({size / args.tokens / 1024:.1f} KiB per token)")
    print(
        f"step loop: saving (copy out) {saved.get('save_seconds', 0) * 1e3:.1f} ms for {saved.get('saved_blocks', 0):.0f} "
        f"blocks, {1e6 * saved.get('save_seconds', 0) / max(blocks, 1):.0f} us/block; writer thread "
        f"{saved.get('write_seconds', 0) * 1e3:.1f} ms; loading {loaded.get('load_seconds', 0) * 1e3:.1f} ms, "
        f"{1e6 * loaded.get('load_seconds', 0) / max(blocks, 1):.0f} us/block (reading, verifying, copying in); "
        f"recomputing {1e6 * cold / max(blocks, 1):.0f} us/block (cold prefill / blocks)"
    )


AGENT_MODES = ("off", "disk", "ram", "ram+disk", "llama", "llama-off")


def llama_server(args) -> Path:
    found = (
        Path(args.llama_server) if args.llama_server else next(PEERS.glob("build/llama.cpp-b*/bin/llama-server"), None)
    )
    if found is None or not found.is_file():
        raise SystemExit("no llama-server: run benchmarks/peers/build_llama_cpp.sh, or pass --llama-server PATH")
    return found


def agent_server(mode: str, args, tmp: Path):
    """A server for one `agent` mode, as (send: prompt ids -> seconds to the first token, its counters
    afterwards)."""
    return (llama_agent_server if mode.startswith("llama") else tokenmill_agent_server)(mode, args, tmp)


@contextmanager
def tokenmill_agent_server(mode: str, args, tmp: Path):
    """tokenmill with `--num-kv-blocks` blocks and the mode's tiers (counters: each tier's)."""
    flags = ["--num-kv-blocks", str(args.kv_blocks), "--max-model-len", str(args.kv_blocks * 16)]
    if "disk" in mode:
        flags += ["--kv-cache-dir", str(tmp / "kv")]
    if "ram" in mode:
        flags += ["--kv-offloading-size", str(args.ram_mib / 1024)]
    srv, _ = start(tmp, args.model, *flags)
    try:
        yield (lambda prompt: ttft(srv, prompt)[0]), lambda: {t: tier(srv, t) for t in ("ram", "disk")}
    finally:
        srv.stop()


@contextmanager
def llama_agent_server(mode: str, args, tmp: Path):
    """llama-server on the same GGUF: `--parallel` slots sharing a context of the pool's tokens (`-c`),
    so the KV does not hold every session either, and its host-RAM prompt cache `--cache-ram` of the
    MiB tokenmill's RAM tier gets (`llama-off`: 0, none). Counters: prompt tokens it evaluated."""
    from tokenmill.loader.source import resolve_model

    port, evaluated = free_port(), []
    cmd = [str(llama_server(args)), "-m", str(resolve_model(args.model).path), "--port", str(port)]
    cmd += ["-t", str(args.threads), "-c", str(args.kv_blocks * 16), "--parallel", str(args.llama_parallel)]
    cmd += ["--cache-ram", "0" if mode == "llama-off" else str(args.ram_mib), "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    with open(tmp / "llama-server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
            time.sleep(0.5)

        def send(prompt: list[int]) -> float:
            began = time.perf_counter()
            r = httpx.post(
                f"{url}/completion",
                json={"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True},
                timeout=3600,
            )
            r.raise_for_status()
            evaluated.append(r.json()["timings"]["prompt_n"])
            return time.perf_counter() - began

        yield send, lambda: {"evaluated": sum(evaluated)}
    finally:
        proc.terminate()
        proc.wait()


def agent(args) -> None:
    system = random.Random(1).choices(range(200, 20000), k=args.system_tokens)
    own = [random.Random(10 + s).choices(range(200, 20000), k=args.own_tokens) for s in range(args.sessions)]
    results = {}
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as tmp, agent_server(mode, args, Path(tmp)) as (send, counters):
            histories = [system + own[s] for s in range(args.sessions)]  # the same token ids in every mode
            times: list[float] = []
            sent: list[int] = []

            def turn(s: int, t: int) -> None:
                histories[s] += random.Random(100 * s + t).choices(range(200, 20000), k=args.turn_tokens)
                sent.append(len(histories[s]))
                seconds = send(histories[s])
                if t:
                    times.append(seconds)
                histories[s] += random.Random(-100 * s - t).choices(range(200, 20000), k=args.answer_tokens)

            began = time.perf_counter()
            with ThreadPoolExecutor(args.sessions) as pool:
                for t in range(args.turns):
                    list(pool.map(lambda s, t=t: turn(s, t), range(args.sessions)))
            total = time.perf_counter() - began
            results[mode] = (times, total, counters(), sum(sent))
    print(
        f"model {args.model}: {args.sessions} sessions x {args.turns} turns, system prompt {args.system_tokens} "
        f"tokens + {args.own_tokens} of its own per session, +{args.turn_tokens} / +{args.answer_tokens} per turn, "
        f"pool {args.kv_blocks} blocks of 16 (llama-server: -c {args.kv_blocks * 16} --parallel "
        f"{args.llama_parallel}), RAM tier / --cache-ram {args.ram_mib} MiB"
    )
    for mode, (times, total, counts, prompt_tokens) in results.items():
        p90 = statistics.quantiles(times, n=10)[8] if len(times) > 1 else times[0]
        extra = "".join(
            f", {name} hits {c['hits']:.0f} of {c['queries']:.0f} looked-up tokens"
            for name, c in counts.items()
            if name in ("ram", "disk") and c.get("queries")
        )
        if "evaluated" in counts:
            extra = f", prompt tokens evaluated {counts['evaluated']} of {prompt_tokens}"
        print(
            f"{mode}: TTFT p50 {statistics.median(times):.2f} s, p90 {p90:.2f} s (turns 2..), total {total:.1f} s{extra}"
        )


def minload(args) -> None:
    """In one process: TTFT of a prompt whose first H tokens are on disk, loaded vs recomputed (the
    pool's prefix cache reset before each), for several H; and what a host-RAM tier would cost per block
    (a copy in memory) against the disk tier's load (read + verify from the page cache + copy in)."""
    import torch

    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.request import EngineCoreRequest
    from tokenmill.executor import UniProcExecutor
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(model=args.model, cache=CacheConfig(kv_cache_dir=tmp, kv_disk_min_load_tokens=16))
        core = EngineCore(config, UniProcExecutor(config), set())
        tier = core.kv_connector
        rng, n = random.Random(2), 0

        def first_token(prompt: list[int]) -> float:
            nonlocal n
            n += 1
            core.reset_prefix_cache()
            began = time.perf_counter()
            core.add_request(EngineCoreRequest(str(n), prompt, params))
            while not any(o.new_token_ids for o in core.step()):
                pass
            seconds = time.perf_counter() - began
            while core.has_unfinished():  # the blocks' writes (not timed)
                core.step()
            return seconds

        print(f"model {args.model}: TTFT (median of {args.repeats}) of H tokens on disk + 16 new ones")
        for hit in args.hits:
            shared = rng.choices(range(200, 20000), k=hit)
            first_token(shared + [1] * 17)  # writes the H tokens' blocks
            core.executor.kv_connector.writer.flush()
            times = {}
            for mode, min_load in (("load", 16), ("recompute", 1 << 30)):
                tier.min_load_tokens = min_load
                times[mode] = statistics.median(
                    first_token(shared + rng.choices(range(200, 20000), k=16)) for _ in range(args.repeats)
                )
            print(
                f"H={hit:5d}: loaded {times['load'] * 1e3:7.1f} ms, recomputed {times['recompute'] * 1e3:7.1f} ms "
                f"({times['recompute'] / times['load']:.2f}x)"
            )
        s = tier.disk_stats
        per_block = s.load_seconds / max(s.hits // config.cache.block_size, 1)
        block = [torch.empty(shape, dtype=dtype) for shape, dtype in tier.layout]
        began = time.perf_counter()
        for _ in range(1000):
            [b.clone() for b in block]
        ram = (time.perf_counter() - began) / 1000
        print(
            f"per block: disk tier load {per_block * 1e6:.0f} us (read, verify, copy in); a RAM copy {ram * 1e6:.0f} us"
        )


def add_model_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--model", default=default, help="a GGUF path or a model name tokenmill resolves (default: %(default)s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restart", help="one long prompt cold, then again after a restart onto the same --kv-cache-dir")
    add_model_flag(r, str(Path.home() / ".cache/tokenmill/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    r.add_argument("--tokens", type=int, default=6000, help="the prompt's length in tokens (default: %(default)s)")
    a = sub.add_parser("agent", help="concurrent multi-turn sessions over a KV pool too small for them all")
    add_model_flag(a, "smollm2-135m-instruct")
    a.add_argument("--sessions", type=int, default=3, help="concurrent sessions (default: %(default)s)")
    a.add_argument("--turns", type=int, default=4, help="turns per session (default: %(default)s)")
    a.add_argument(
        "--system-tokens",
        type=int,
        default=500,
        help="tokens of the system prompt every session shares (default: %(default)s)",
    )
    a.add_argument(
        "--own-tokens",
        type=int,
        default=800,
        help="tokens of each session's own context (files) in its first turn (default: %(default)s)",
    )
    a.add_argument(
        "--turn-tokens", type=int, default=32, help="the new user tokens of each later turn (default: %(default)s)"
    )
    a.add_argument("--answer-tokens", type=int, default=16, help="tokens generated per turn (default: %(default)s)")
    a.add_argument(
        "--kv-blocks",
        type=int,
        default=112,
        help="tokenmill's KV pool, in blocks (too small on purpose) (default: %(default)s)",
    )
    a.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=list(AGENT_MODES[:4]),
        help=f"comma-separated, of {', '.join(AGENT_MODES)} (llama: llama-server with its --cache-ram prompt "
        "cache; llama-off: --cache-ram 0) (default: the tokenmill ones)",
    )
    a.add_argument(
        "--ram-mib",
        type=int,
        default=1024,
        help="tokenmill's RAM tier and llama-server's --cache-ram, in MiB (default: %(default)s)",
    )
    a.add_argument("--llama-server", help="the llama-server binary (default: benchmarks/peers/build's)")
    a.add_argument(
        "--llama-parallel",
        type=int,
        default=1,
        help="llama-server --parallel (slots sharing -c) (default: %(default)s)",
    )
    a.add_argument("--threads", type=int, default=2, help="llama-server -t: its threads (default: %(default)s)")
    m = sub.add_parser("minload", help="loading a prefix from disk against recomputing it, by its length")
    add_model_flag(m, "smollm2-135m-instruct")
    m.add_argument(
        "--hits",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128, 512],
        help="prefix lengths, in tokens (default: %(default)s)",
    )
    m.add_argument(
        "--repeats", type=int, default=3, help="runs per length (the median is reported) (default: %(default)s)"
    )
    args = parser.parse_args()
    {"restart": restart, "agent": agent, "minload": minload}[args.cmd](args)


if __name__ == "__main__":
    main()
