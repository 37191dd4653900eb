"""Tensor and pipeline parallelism's cost on this machine: decode with each layout (TPxPP, optionally
`:ray` for Ray actors instead of worker processes), each in a fresh process, same prompts, back to
back; the driver's time in communication per decode step (collectives, sends, and waiting to receive
from the pipeline's last stage) and the bytes it moves per token (collectives; hidden states sent point
to point to the next stage). Then, on paper, what TP / PP / EP move on an 8-GPU node.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--model DIR_OR_GGUF] [--layouts 1x1,2x1,1x2,1x2:ray]
        [--batches 1,8] [--prompt-len 128] [--tokens 32] [--dtype float32]

Default model: Qwen2.5-Coder-0.5B dequantized to an HF checkpoint by benchmarks/peers/gguf_to_hf.py
(14 heads, 2 kv heads: splits over 2 ranks; 24 layers: 2 stages of 12). Prints markdown tables.
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

model, dtype, layout, batch, prompt_len, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *map(int, sys.argv[4:7])
config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig(num_blocks=(prompt_len + tokens) // 16 * batch + 64),
                      scheduler=SchedulerConfig(max_num_batched_tokens=max(512, prompt_len * batch)),
                      parallel=ParallelConfig(**layout))
executor = executor_for(config)
core = EngineCore(config, executor, set())
vocab = executor.model_config.vocab_size
rng = np.random.default_rng(0)
for i in range(batch):
    prompt = rng.integers(100, min(vocab, 20000), prompt_len).tolist()
    core.add_request(EngineCoreRequest(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
while not core.step():  # the prefill (one model step: the budget holds every prompt; a pipeline returns it later)
    pass
stats = parallel_state.stats
stats.__init__()
start = time.perf_counter()
while core.has_unfinished():
    core.step()
seconds = time.perf_counter() - start
result = json.dumps({"seconds": seconds, "steps": tokens - 1, "decoded": batch * (tokens - 1), "calls": stats.calls,
                     "comm_seconds": stats.seconds, "bytes": stats.bytes})
if config.parallel.world_size > 1:
    executor.close()
print("RESULT " + result)
"""


def parse_layout(text: str) -> dict:
    """ "TPxPP[:backend]" (e.g. 2x1, 1x2:ray) as ParallelConfig fields."""
    sizes, _, backend = text.partition(":")
    tp, pp = map(int, sizes.split("x"))
    return dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend=backend or "mp")


def run(model: str, dtype: str, layout: str, batch: int, prompt_len: int, tokens: int) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN,
            model,
            dtype,
            json.dumps(parse_layout(layout)),
            str(batch),
            str(prompt_len),
            str(tokens),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        sys.exit(f"layout {layout} batch={batch} failed:\n{done.stderr[-3000:]}")
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
    rows.append(
        f"| Llama-3-8B | TP=8 | 2 all-reduces of the hidden state per layer (x{layers}) + logits gather "
        f"| {tp / 1e3:,.0f} KB |"
    )
    rows.append(
        f"| Llama-3-8B | PP=8 | the hidden state across each of 7 stage boundaries | {hidden * 2 / 1e3:,.1f} KB "
        "per boundary |"
    )
    # DeepSeek-V3: 61 layers (3 dense + 58 MoE), hidden 7168, 256 routed experts, top-8, vocab 129280
    layers, moe, hidden, top_k, vocab = 61, 58, 7168, 8, 129280
    tp = layers * 2 * hidden * 2 * ring + vocab // n * 4
    rows.append(
        f"| DeepSeek-V3 (671B MoE) | TP=8 | 2 all-reduces per layer (x{layers}) + logits gather | {tp / 1e3:,.0f} KB |"
    )
    remote = top_k * (n - 1) / n  # of a token's 8 experts, ~7/8 live on other ranks (uniform routing)
    ep = moe * remote * hidden * (1 + 2)  # dispatch fp8 + combine bf16
    rows.append(
        f"| DeepSeek-V3 (671B MoE) | EP=8 (attention DP) | all-to-all dispatch (fp8) + combine (bf16) to "
        f"~{remote:.0f} remote experts per MoE layer (x{moe}) | {ep / 1e6:,.1f} MB |"
    )
    rows.append(
        f"| DeepSeek-V3 (671B MoE) | PP=8 | the hidden state across each stage boundary | {hidden * 2 / 1e3:,.1f} KB "
        "per boundary |"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="HF directory or .gguf (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    ap.add_argument(
        "--layouts",
        default="1x1,2x1,1x2",
        help="TPxPP[:backend] layouts, backend mp (default) or ray (default: %(default)s)",
    )
    ap.add_argument("--batches", default="1,8", help="concurrent requests (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    args = ap.parse_args()
    print(
        "| layout (TPxPP) | requests | decode tok/s | ms / step | communication ms / step (share) | "
        "all-reduce calls / step | collective bytes / token / rank | p2p bytes / token / rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for layout in args.layouts.split(","):
            r = run(args.model, args.dtype, layout, batch, args.prompt_len, args.tokens)
            step_ms = r["seconds"] / r["steps"] * 1e3
            comm = sum(r["comm_seconds"].values()) / r["steps"] * 1e3
            calls = r["calls"].get("all_reduce", 0) / r["steps"]
            collective = sum(r["bytes"].get(k, 0) for k in ("all_reduce", "all_gather")) / r["decoded"]
            p2p = sum(r["bytes"].get(k, 0) for k in ("send", "send_object")) / r["decoded"]
            print(
                f"| {layout} | {batch} | {r['decoded'] / r['seconds']:.1f} | {step_ms:.1f} | "
                f"{comm:.1f} ({comm / step_ms:.0%}) | {calls:.0f} | {collective / 1e3:.1f} KB | {p2p / 1e3:.1f} KB |",
                flush=True,
            )
    print()
    print("\n".join(on_paper()))


if __name__ == "__main__":
    main()
