"""Prefill and decode speed of each real model: tokenmill vs transformers on the same GGUF file, same run.

    .venv/bin/python benchmarks/bench_models.py [--models gemma-3-270m,qwen2.5-coder-0.5b] [--prompt-len 512]

Models come from ../shared/models/fetch.sh (or pass .gguf paths). tokenmill runs the file in each of
--quantizations (auto: the default, gguf-q8 on CPU; gguf: the exact mode; none: dense float32);
transformers dequantizes the file to float32. Prefill: prompt tokens / time to the first token;
decode: tokens/s after the first. Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
from pathlib import Path

import torch

FETCH = Path(__file__).resolve().parents[2] / "shared" / "models" / "fetch.sh"


def model_path(name: str) -> Path:
    if name.endswith(".gguf"):
        return Path(name)
    out = subprocess.run(["bash", str(FETCH), name], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def tokenmill_speeds(
    path: Path, prompt: list[int], n: int, repeats: int, quantization: str = "auto", kv_cache_dtype: str = "auto"
) -> tuple[float, float, str]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        str(path), num_kv_blocks=(len(prompt) + n) // 16 + 4, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first run warms up
        llm.engine.core.reset_prefix_cache()
        m = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].metrics
        prefill.append(len(prompt) / (m.first_token_time - m.first_scheduled_time))
        decode.append((len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0]))
    return statistics.median(prefill[1:]), statistics.median(decode[1:]), llm.engine.core.executor.quantization


def transformers_speeds(path: Path, prompt: list[int], n: int, repeats: int) -> tuple[float, float]:
    from bench_decode import hf_generate_speeds  # this script's neighbour (benchmarks/ is on sys.path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    runs = [hf_generate_speeds(hf, prompt, n) for _ in range(repeats + 1)][1:]  # the first run warms up
    return statistics.median(p for p, _ in runs), statistics.median(d for _, d in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="gemma-3-270m,qwen2.5-coder-0.5b",
        help="comma-separated fetch.sh names or .gguf paths (default: %(default)s)",
    )
    ap.add_argument("--prompt-len", type=int, default=512, help="random prompt length in tokens (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to decode per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row, median reported (default: %(default)s)")
    ap.add_argument("--quantizations", default="auto", help="tokenmill --quantization values (default: %(default)s)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="tokenmill's --kv-cache-dtype (default: %(default)s)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; prompt {args.prompt_len} tokens, decode {args.tokens}; medians of {args.repeats}"
    )
    print(
        f"{'model':<22} {'tokenmill weights':<18} {'prefill tok/s':>14} {'hf prefill':>11} {'decode tok/s':>13} "
        f"{'hf decode':>10} {'decode ratio':>13}"
    )
    for name in args.models.split(","):
        path = model_path(name)
        rng = random.Random(0)
        prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
        hp, hd = (
            (float("nan"),) * 2
            if args.no_transformers
            else transformers_speeds(path, prompt, args.tokens, args.repeats)
        )
        for quantization in args.quantizations.split(","):
            tp, td, quant = tokenmill_speeds(path, prompt, args.tokens, args.repeats, quantization, args.kv_cache_dtype)
            print(
                f"{Path(name).name:<22} {quant:<18} {tp:>14.1f} {hp:>11.1f} {td:>13.1f} {hd:>10.1f} {td / hd:>12.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
