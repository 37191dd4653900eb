"""Single-stream decode speed: tokenmill vs transformers.generate on the same weights, same run.

    .venv/bin/python benchmarks/bench_decode.py [--model smollm2-135m-instruct] [--tokens 128] [--dtypes float32,bfloat16]

Prints tokens/s (median of --repeats runs) for each dtype and tokenmill weight format (gguf blocks,
dense, int8), and the ratio tokenmill / transformers (transformers dequantizes a GGUF file to dense
weights in that dtype).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def tokenmill_decode(llm, prompt_ids: list[int], n: int) -> float:
    from tokenmill import SamplingParams

    out = llm.generate(
        {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )[0]
    times = out.metrics.token_times
    return (len(times) - 1) / (times[-1] - times[0])  # decode rate, first token (prefill) excluded


def hf_generate_speeds(model, prompt_ids: list[int], n: int) -> tuple[float, float]:
    """transformers.generate, greedy: (prefill tokens/s, decode tokens/s after the first token)."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        total = time.perf_counter() - start
    return len(prompt_ids) / prefill, (n - 1) / (total - prefill)


def hf_decode(model, prompt_ids: list[int], n: int) -> float:
    return hf_generate_speeds(model, prompt_ids, n)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate per run (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row, median printed (default: %(default)s)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes both engines run in (default: %(default)s)")
    ap.add_argument(
        "--quantizations",
        default="auto,none,int8",
        help="tokenmill weight formats to measure in each dtype (see --quantization of "
        "`tokenmill serve`); a format that does not apply to a dtype is skipped (default: %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for both engines (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from tokenmill import LLM
    from tokenmill.loader.source import resolve_model
    from tokenmill.quantization import resolve_quantization

    src = resolve_model(args.model)
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {args.threads} threads, {args.tokens} tokens, prompt {args.prompt_len}"
    )
    print(f"{'dtype':<10} {'weights':<8} {'tokenmill tok/s':>16} {'transformers tok/s':>19} {'ratio':>7}")
    prompt = list(range(100, 100 + args.prompt_len))
    for dtype in args.dtypes.split(","):
        if src.kind == "gguf":
            hf = AutoModelForCausalLM.from_pretrained(
                str(src.path.parent), gguf_file=src.path.name, dtype=getattr(torch, dtype)
            ).eval()
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=getattr(torch, dtype)).eval()
        torch.set_num_threads(args.threads)
        theirs = statistics.median(hf_decode(hf, prompt, args.tokens) for _ in range(args.repeats))
        done = set()
        for quant in args.quantizations.split(","):
            try:
                weights = resolve_quantization(quant, src.kind, torch.device("cpu"), getattr(torch, dtype))
            except ValueError:
                continue
            if weights in done or (weights == "int8" and dtype != "float32"):
                continue
            done.add(weights)
            llm = LLM(model=args.model, dtype=dtype, num_kv_blocks=64, quantization=weights)
            torch.set_num_threads(args.threads)
            tokenmill_decode(llm, prompt, 8)  # warm-up
            ours = statistics.median(tokenmill_decode(llm, prompt, args.tokens) for _ in range(args.repeats))
            print(f"{dtype:<10} {weights:<8} {ours:>16.1f} {theirs:>19.1f} {ours / theirs:>6.2f}x", flush=True)
            del llm
        del hf


if __name__ == "__main__":
    main()
