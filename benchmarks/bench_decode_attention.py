"""The CPU paged decode attention kernel as a single-stream decode step runs it: SmolLM2-135M's shapes
(9 query heads on 3 kv heads of 64 dims, float16 cache, blocks of 16 scattered through the pool), one
query per layer over 30 layers' caches in turn, 64 MB of other memory written between rounds (the
weights a step streams), so each layer's K/V comes from L3 or memory as in a real step, not from L2.

    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_decode_attention.py [CONTEXT ...]

Prints the best of 40 rounds per layer, at 1 and 2 threads. Run it for two trees in turn to compare.
"""

from __future__ import annotations

import sys
import time

import torch

from tokenmill.kernels import paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, ROUNDS = 9, 3, 64, 16, 30, 40


def per_layer_us(context: int, threads: int) -> float:
    torch.manual_seed(0)
    blocks = context // BLOCK + 4
    caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).half() for _ in range(2)) for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, HEAD_DIM)
    table = torch.randperm(blocks)[: -(-context // BLOCK)].unsqueeze(0)
    lengths = torch.tensor([context])
    other = torch.empty(16 << 20)
    torch.set_num_threads(threads)
    best = float("inf")
    for r in range(ROUNDS):
        other.fill_(r)
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            paged_attention.paged_decode_attention(q, k_cache, v_cache, table, lengths, HEAD_DIM**-0.5)
        best = min(best, time.perf_counter() - start)
    return best / LAYERS * 1e6


def main() -> None:
    for context in [int(a) for a in sys.argv[1:]] or [576, 2048]:
        for threads in (1, 2):
            print(f"context {context} threads {threads}: {per_layer_us(context, threads):.1f} us/layer")


if __name__ == "__main__":
    main()
