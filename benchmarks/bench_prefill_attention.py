"""A prompt chunk's attention on CPU, one layer: the torch path the cpu-paged backend took before (SDPA on
the chunk's own float32 K/V when nothing is cached; else the cached blocks gathered into a contiguous
copy, then SDPA under a mask) against the C++ prefill kernel reading the blocks in place
(`paged_attention.paged_prefill_attention`). A float16 cache in blocks of 16 scattered through the pool
(gguf-q8's default). Shapes: SmolLM2-135M's (9 query heads on 3 kv heads of 64 dims) and Qwen2.5-0.5B's
(14 on 2); chunks: 200 tokens at the prompt's start, 256 after 1,024 cached.

    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_prefill_attention.py [--rounds N]

Both run in one process, taking turns (torch, kernel, torch, ...) at 1 then 2 threads; prints each one's
median time per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.metadata import build_common_metadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend

SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}  # query heads, kv heads, head dim
CHUNKS = ((0, 200), (1024, 256))  # (cached tokens, chunk)
BLOCK = 16


def timings(model: str, cached: int, n: int, threads: int, rounds: int) -> tuple[float, float]:
    """(torch path, kernel) median seconds per call."""
    heads, kv_heads, head_dim = SHAPES[model]
    torch.manual_seed(0)
    blocks = -(-(cached + n) // BLOCK)
    table = torch.randperm(2 * blocks)[:blocks].tolist()
    common, _ = build_common_metadata(np.array([n]), np.array([cached]), [table], BLOCK, torch.device("cpu"))
    cache = torch.randn(2, 2 * blocks, BLOCK, kv_heads, head_dim).half()
    q, k, v = (torch.randn(n, h, head_dim) for h in (heads, kv_heads, kv_heads))
    calls = []
    for backend in (TorchSDPABackend(), CpuPagedBackend()):
        meta = backend.build_metadata(common)
        p = meta.prefills[0]
        calls.append(lambda b=backend, m=meta, p=p: b._prefill(q, k, v, cache[0], cache[1], p, m, head_dim**-0.5))
    torch.set_num_threads(threads)
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for call, spent in zip(calls, times):
            start = time.perf_counter()
            for _ in range(5):
                call()
            spent.append((time.perf_counter() - start) / 5)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="turns each (5 calls a turn)")
    args = parser.parse_args()
    for threads in (1, 2):
        for model in SHAPES:
            for cached, n in CHUNKS:
                sdpa, kernel = timings(model, cached, n, threads, args.rounds)
                print(
                    f"{model:13} chunk {n} after {cached:4}  threads {threads}: torch {sdpa * 1e3:.3f} ms, "
                    f"kernel {kernel * 1e3:.3f} ms  ({sdpa / kernel:.2f}x)"
                )


if __name__ == "__main__":
    main()
