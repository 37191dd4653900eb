"""The block-quantized matmul kernels on one weight shape, per GGUF type: time per call and weights/s.

    .venv/bin/python benchmarks/bench_block_kernels.py [--types Q4_K,Q5_0,Q6_K,Q8_0] [--shape 17920x1536]
        [--rows 1] [--copies 12] [--mode q8|float]

Random blocks of each type (as the tests build them) packed as `tokenmill.quantization.gguf` packs
them for gguf-q8 (`--mode q8`, int8 activations) or the exact mode (`--mode float`). `--copies`
weights are cycled so that each call reads its weight from memory, as a decode step does (one copy:
from cache). Medians of --repeats passes over all copies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_quantization import random_gguf_tensor  # noqa: E402  (the tests' block builder)
from tokenmill.kernels import block_quant  # noqa: E402
from tokenmill.layers.linear import ReplicatedLinear  # noqa: E402
from tokenmill.quantization.gguf import GGUFConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0", help="comma-separated GGUF types")
    ap.add_argument("--shape", default="17920x1536", help="weight rows x columns (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (default: %(default)s)")
    ap.add_argument("--copies", type=int, default=12, help="weights cycled through (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="passes over all copies (default: %(default)s)")
    ap.add_argument("--mode", choices=["q8", "float"], default="q8", help="gguf-q8 or the exact mode's kernel")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    x = torch.randn(args.rows, k)
    out = torch.empty(args.rows, n)
    print(f"# {args.mode} kernel, {n}x{k}, {args.rows} activation row(s), {args.copies} copies, "
          f"{torch.get_num_threads()} threads")
    print(f"{'type':6s} {'bits':>4s} {'us/call':>9s} {'G weights/s':>12s} {'GB/s':>6s}")
    for qtype in args.types.split(","):
        weight, _ = random_gguf_tensor(qtype, n, k, np.random.default_rng(0))
        config = GGUFConfig({"w.weight": qtype}, int8_activations=args.mode == "q8")
        copies = []
        for _ in range(args.copies):
            layer = ReplicatedLinear(k, n, quant_config=config, prefix="w")
            layer.weight_loader("weight", weight)
            copies.append(layer.quant_method.blocks(layer))
        nbytes = sum(t.numel() * t.element_size() for t in copies[0].args()[:5] if t is not None)
        call = block_quant.load().block_quant_matmul_q8 if args.mode == "q8" else block_quant.load().block_quant_matmul
        times = []
        for rep in range(args.repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            for w in copies:
                call(x, *w.args(), out)
            times.append((time.perf_counter() - start) / len(copies))
        t = statistics.median(times[1:])
        print(f"{qtype:6s} {copies[0].bits:4d} {t * 1e6:9.0f} {n * k * args.rows / t / 1e9:12.1f} {nbytes / t / 1e9:6.1f}")


if __name__ == "__main__":
    main()
