"""Tensor parallelism's cost on this machine: decode with --tensor-parallel-size 1 and 2, each in a
fresh process, same prompts, back to back; the driver's time in collectives per step and the bytes
each rank contributes per token. Then, on paper, what TP / PP / EP move on an 8-GPU node.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--model DIR_OR_GGUF] [--sizes 1,2]
        [--batches 1,8] [--prompt-len 128] [--tokens 32] [--dtype float32]

Default model: Qwen2.5-Coder-0.5B dequantized to an HF checkpoint by benchmarks/peers/gguf_to_hf.py
(14 heads, 2 kv heads: splits over 2 ranks). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "benchmarks/peers/build/hf/qwen2.5-coder-0.5b-instruct-q4_k_m"

_RUN = r"""
import json, sys, time
import numpy as np
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.distributed import parallel_state
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

model, dtype, size, batch, prompt_len, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig(num_blocks=(prompt_len + tokens) // 16 * batch + 64),
                      scheduler=SchedulerConfig(max_num_batched_tokens=max(512, prompt_len * batch)),
                      parallel=ParallelConfig(tensor_parallel_size=size))
executor = executor_for(config)
core = EngineCore(config, executor, set())
vocab = executor.model_config.vocab_size
rng = np.random.default_rng(0)
for i in range(batch):
    prompt = rng.integers(100, min(vocab, 20000), prompt_len).tolist()
    core.add_request(EngineCoreRequest(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
core.step()  # the prefill (one step: the budget holds every prompt)
stats = parallel_state.stats
stats.__init__()
start, steps = time.perf_counter(), 0
while core.has_unfinished():
    core.step()
    steps += 1
seconds = time.perf_counter() - start
decoded = batch * (tokens - 1)
if size > 1:
    executor.close()
print("RESULT " + json.dumps({"seconds": seconds, "steps": steps, "decoded": decoded, "calls": stats.calls,
                              "comm_seconds": stats.seconds, "bytes": stats.bytes}))
"""


def run(model: str, dtype: str, size: int, batch: int, prompt_len: int, tokens: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN, model, dtype, str(size), str(batch), str(prompt_len), str(tokens)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"tp={size} batch={batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def on_paper() -> list[str]:
    """Bytes each rank sends per token on an 8-GPU node (bf16 activations; ring all-reduce sends
    2 (N-1)/N of the payload; EP dispatch in fp8 and combine in bf16, as DeepSeek-V3's serving does)."""
    n = 8
    ring = 2 * (n - 1) / n
    rows = ["| model | mode (8 ranks) | what moves per token | bytes per token per rank |", "|---|---|---|---|"]
    # Llama-3-8B: 32 layers, hidden 4096, vocab 128256
    layers, hidden, vocab = 32, 4096, 128256
    tp = layers * 2 * hidden * 2 * ring + vocab // n * 4  # 2 all-reduces per layer + the logits gather (fp32)
    rows.append(f"| Llama-3-8B | TP=8 | 2 all-reduces of the hidden state per layer (x{layers}) + logits gather "
                f"| {tp / 1e3:,.0f} KB |")
    rows.append(f"| Llama-3-8B | PP=8 | the hidden state across each of 7 stage boundaries | {hidden * 2 / 1e3:,.1f} KB "
                "per boundary |")
    # DeepSeek-V3: 61 layers (3 dense + 58 MoE), hidden 7168, 256 routed experts, top-8, vocab 129280
    layers, moe, hidden, top_k, vocab = 61, 58, 7168, 8, 129280
    tp = layers * 2 * hidden * 2 * ring + vocab // n * 4
    rows.append(f"| DeepSeek-V3 (671B MoE) | TP=8 | 2 all-reduces per layer (x{layers}) + logits gather | {tp / 1e3:,.0f} KB |")
    remote = top_k * (n - 1) / n  # of a token's 8 experts, ~7/8 live on other ranks (uniform routing)
    ep = moe * remote * hidden * (1 + 2)  # dispatch fp8 + combine bf16
    rows.append(f"| DeepSeek-V3 (671B MoE) | EP=8 (attention DP) | all-to-all dispatch (fp8) + combine (bf16) to "
                f"~{remote:.0f} remote experts per MoE layer (x{moe}) | {ep / 1e6:,.1f} MB |")
    rows.append(f"| DeepSeek-V3 (671B MoE) | PP=8 | the hidden state across each stage boundary | {hidden * 2 / 1e3:,.1f} KB "
                "per boundary |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="HF directory or .gguf (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes (default: %(default)s)")
    ap.add_argument("--batches", default="1,8", help="concurrent requests (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    args = ap.parse_args()
    print("| tp | requests | decode tok/s | ms / step | collectives ms / step (share) | all-reduce calls / step | "
          "bytes / token / rank |")
    print("|---|---|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for size in map(int, args.sizes.split(",")):
            r = run(args.model, args.dtype, size, batch, args.prompt_len, args.tokens)
            step_ms = r["seconds"] / r["steps"] * 1e3
            comm = sum(v for k, v in r["comm_seconds"].items()) / r["steps"] * 1e3
            calls = r["calls"].get("all_reduce", 0) / r["steps"]
            moved = sum(r["bytes"].values()) / r["decoded"]
            print(f"| {size} | {batch} | {r['decoded'] / r['seconds']:.1f} | {step_ms:.1f} | "
                  f"{comm:.1f} ({comm / step_ms:.0%}) | {calls:.0f} | {moved / 1e3:.1f} KB |", flush=True)
    print()
    print("\n".join(on_paper()))


if __name__ == "__main__":
    main()
