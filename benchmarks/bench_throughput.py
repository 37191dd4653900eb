"""Offline throughput: tokenmill continuous batching vs transformers.generate with static batches.

    .venv/bin/python benchmarks/bench_throughput.py [--num-prompts 128] [--output-len 128] [--hf-batch 16]

Prompts are 100-400 tokens of real text (Python standard-library source), every request generates
exactly --output-len tokens (ignore_eos). Both engines run on the same prompts in the same process;
the report gives output tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import time

import torch


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    import argparse as m1  # noqa: E401 (text sources)
    import collections as m2
    import json as m3
    import logging as m4

    corpus = tokenizer.encode("\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4)))
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(len(corpus) - length)
        prompts.append(corpus[start : start + length])
    return prompts


def run_tokenmill(llm, prompts, output_len: int) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def run_transformers(model, prompts, output_len: int, batch: int, pad_id: int) -> float:
    from tqdm import tqdm

    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc="transformers"):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.full((len(group), width), pad_id)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for j, p in enumerate(group):  # left padding
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=None,
            )
        assert out.shape[1] == width + output_len
    return len(prompts) * output_len / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=128, help="requests, submitted at once (default: %(default)s)")
    ap.add_argument("--min-input-len", type=int, default=100, help="shortest prompt in tokens (default: %(default)s)")
    ap.add_argument("--max-input-len", type=int, default=400, help="longest prompt in tokens (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: %(default)s)")
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="most requests in flight (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default: %(default)s)")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="tokenmill compute dtypes to measure, one run each; transformers runs in float32 (default: %(default)s)",
    )
    ap.add_argument(
        "--quantization",
        default="auto",
        help="tokenmill weight format: auto (default: a GGUF file's own blocks in float32), none, gguf, int8",
    )
    ap.add_argument("--skip-transformers", action="store_true", help="measure tokenmill only")
    ap.add_argument("--result-file", default=None, help="write the numbers as JSON here (default: not written)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tokenmill import LLM
    from tokenmill.loader.source import resolve_model

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "torch": torch.__version__,
        **vars(args),
        "tokenmill_output_tok_s": {},
    }
    for dtype in args.dtypes.split(","):
        llm = LLM(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=2.0,
            dtype=dtype,
            quantization=args.quantization,
        )
        tok = llm.get_tokenizer()
        prompts = make_prompts(tok, args.num_prompts, args.min_input_len, args.max_input_len, seed=0)
        result["threads"] = torch.get_num_threads()
        result["tokenmill_output_tok_s"][dtype] = run_tokenmill(llm, prompts, args.output_len)
        print(f"tokenmill {dtype}: {result['tokenmill_output_tok_s'][dtype]:.1f} output tok/s", flush=True)
        del llm
    if not args.skip_transformers:
        src = resolve_model(args.model)
        if src.kind == "gguf":
            hf = AutoModelForCausalLM.from_pretrained(
                str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
            ).eval()
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval()
        result["transformers_output_tok_s"] = run_transformers(
            hf, prompts, args.output_len, args.hf_batch, tok.hf.pad_token_id or 0
        )
        print(
            f"transformers: {result['transformers_output_tok_s']:.1f} output tok/s (static batches of {args.hf_batch})"
        )
        for dtype, value in result["tokenmill_output_tok_s"].items():
            print(f"ratio tokenmill {dtype} / transformers float32: {value / result['transformers_output_tok_s']:.2f}x")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
