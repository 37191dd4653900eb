"""Expert parallelism's cost on this machine: a random-weight Qwen3-MoE decoded by one process, by
two tensor-parallel ranks (every expert split by its intermediate features, one all-reduce per MoE
layer) and by two expert-parallel ranks (whole experts per rank, all-to-all dispatch and combine plus
an all-gather), each in a fresh process, same prompts, back to back. Reports the prefill step's time; per decode step: median time,
the driver's (rank 0's) time in collectives and its bytes sent per decoded token by collective kind,
and how the routed tokens split over the ranks' experts.

    .venv/bin/python benchmarks/bench_expert_parallel.py [--sizes tiny,medium] [--batches 1,8]
        [--prompt-len 128] [--tokens 32] [--workdir /tmp/tokenmill-bench-ep]

tiny: hidden 64, 2 layers, 8 experts (top 3); medium: hidden 1024, 8 layers, 16 experts (top 4) of
intermediate 512 (~0.3B parameters). Checkpoints are written once under --workdir. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODELS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        vocab_size=256,
    ),
    "medium": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        vocab_size=32000,
    ),
}
MODES = [("1 process", 1, False), ("TP=2", 2, False), ("EP=2", 2, True)]


def checkpoint(name: str, workdir: Path) -> Path:
    """A random-weight Qwen3-MoE of size `name`, written once."""
    directory = workdir / f"qwen3-moe-{name}"
    if not (directory / "config.json").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.Qwen3MoeConfig(
            **MODELS[name],
            head_dim=MODELS[name]["hidden_size"] // MODELS[name]["num_attention_heads"],
            norm_topk_prob=True,
            max_position_embeddings=4096,
        )
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def measure(model: str, size: int, expert_parallel: bool, batch: int, prompt_len: int, tokens: int) -> dict:
    """One engine's decode (run in a fresh process: the ranks join a process group and bind cores)."""
    from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from tokenmill.distributed import parallel_state
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.request import EngineCoreRequest
    from tokenmill.executor import executor_for
    from tokenmill.sampling_params import SamplingParams

    config = EngineConfig(
        model=model,
        dtype="float32",
        cache=CacheConfig(num_blocks=(prompt_len + tokens) // 16 * batch + 64),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(512, prompt_len * batch)),
        parallel=ParallelConfig(tensor_parallel_size=size, enable_expert_parallel=expert_parallel),
    )
    executor = executor_for(config)
    core = EngineCore(config, executor, set())
    rng = np.random.default_rng(0)
    for i in range(batch):
        prompt = rng.integers(0, executor.model_config.vocab_size, prompt_len).tolist()
        core.add_request(
            EngineCoreRequest(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        )
    step_seconds = []  # the first is the prefill (one step: the budget holds every prompt)
    while core.has_unfinished():
        if len(step_seconds) == 1:  # collectives counted from the first decode step on
            parallel_state.stats.__init__()
        start = time.perf_counter()
        core.step()
        step_seconds.append(time.perf_counter() - start)
    stats = parallel_state.stats
    rank_tokens = core.stats().moe_rank_tokens
    if size > 1:
        executor.close()
    return {
        "prefill_seconds": step_seconds[0],
        "step_seconds": step_seconds[1:],
        "decoded": batch * (tokens - 1),
        "comm_seconds": stats.seconds,
        "bytes": stats.bytes,
        "rank_tokens": rank_tokens,
    }


def run(model: Path, size: int, expert_parallel: bool, batch: int, prompt_len: int, tokens: int) -> dict:
    args = json.dumps([str(model), size, expert_parallel, batch, prompt_len, tokens])
    done = subprocess.run([sys.executable, __file__, "--measure", args], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"{model.name} size={size} ep={expert_parallel} batch={batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def row(name: str, mode: str, batch: int, r: dict) -> str:
    steps, seconds = len(r["step_seconds"]), sum(r["step_seconds"])
    step_ms = float(np.median(r["step_seconds"])) * 1e3
    comm_ms = sum(r["comm_seconds"].values()) / steps * 1e3
    moved = ", ".join(f"{kind} {n / r['decoded'] / 1e3:.1f}" for kind, n in sorted(r["bytes"].items()) if n) or "-"
    ranks = r["rank_tokens"]
    split = " / ".join(f"{n / sum(ranks):.0%}" for n in ranks) if ranks and sum(ranks) else "-"
    return (
        f"| {name} | {mode} | {batch} | {r['prefill_seconds'] * 1e3:.0f} | {step_ms:.1f} | "
        f"{r['decoded'] / seconds:.1f} | {comm_ms:.1f} ({comm_ms * steps / seconds / 1e3:.0%}) | {moved} | {split} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,medium", help=f"models, of {', '.join(MODELS)} (default: %(default)s)")
    ap.add_argument(
        "--batches",
        default="1,8",
        help="concurrent requests per run, comma-separated: one row each (default: %(default)s)",
    )
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/tokenmill-bench-ep"),
        help="where the random checkpoints are written (default: %(default)s)",
    )
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one run, in its own process
    args = ap.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure(*json.loads(args.measure))))
        return
    print(
        "| model | mode | requests | prefill ms | decode ms / step (median) | decode tok/s | rank 0 collectives ms / "
        "step (share of decode time) | rank 0 KB sent / decoded token, by collective | routed tokens per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.sizes.split(","):
        model = checkpoint(name, args.workdir)
        for batch in map(int, args.batches.split(",")):
            for mode, size, expert_parallel in MODES:
                r = run(model, size, expert_parallel, batch, args.prompt_len, args.tokens)
                print(row(name, mode, batch, r), flush=True)


if __name__ == "__main__":
    main()
