"""The CPU paged decode attention kernel as a decode step runs it: one query per sequence and layer over
each layer's cache in turn (float16, blocks of 16 scattered through the pool), 64 MB of other memory
written between rounds (the weights a step streams), so each layer's K/V comes from L3 or memory as in a
real step, not from L2. Shapes: SmolLM2-135M's (9 query heads on 3 kv heads of 64 dims, 30 layers) or
with --model qwen2.5-0.5b Qwen2.5-0.5B's (14 on 2, 64 dims, 24 layers); --batch 16 runs 16 sequences of
the context each, as serving at 16 concurrent does. --hot: one layer's cache called over and over, nothing
written between rounds, so K/V stay in L2/L3: the kernel's compute alone.

    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_decode_attention.py [CONTEXT ...] [--batch N]
        [--model smollm2|qwen2.5-0.5b] [--hot]

Prints the best of 40 rounds (10 with a batch, 200 hot) per layer, at 1 and 2 threads. Run it for two trees in
turn to compare.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import paged_attention

SHAPES = {  # query heads, kv heads, head dim, layers
    "smollm2": (9, 3, 64, 30),
    "qwen2.5-0.5b": (14, 2, 64, 24),
}
BLOCK = 16


def per_layer_us(model: str, context: int, batch: int, threads: int, hot: bool = False) -> float:
    heads, kv_heads, head_dim, layers = SHAPES[model]
    layers = 1 if hot else layers
    torch.manual_seed(0)
    per_sequence = -(-context // BLOCK)
    blocks = per_sequence * batch + 4
    caches = [tuple(torch.randn(blocks, BLOCK, kv_heads, head_dim).half() for _ in range(2)) for _ in range(layers)]
    q = torch.randn(batch, heads, head_dim)
    tables = torch.randperm(blocks)[: per_sequence * batch].view(batch, per_sequence)
    lengths = torch.full((batch,), context)
    other = torch.empty(0 if hot else 16 << 20)
    torch.set_num_threads(threads)
    best = float("inf")
    for r in range(200 if hot else 40 if batch == 1 else 10):
        other.fill_(r)
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, head_dim**-0.5)
        best = min(best, time.perf_counter() - start)
    return best / layers * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("contexts", nargs="*", type=int, default=[576, 2048], help="context lengths (tokens)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call, each of the context")
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2", help="whose attention shapes")
    parser.add_argument("--hot", action="store_true", help="one layer's cache, kept in cache: compute alone")
    args = parser.parse_args()
    for context in args.contexts:
        for threads in (1, 2):
            us = per_layer_us(args.model, context, args.batch, threads, args.hot)
            hot = " hot" if args.hot else ""
            print(f"{args.model} context {context} batch {args.batch}{hot} threads {threads}: {us:.1f} us/layer")


if __name__ == "__main__":
    main()
