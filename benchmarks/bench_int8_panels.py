"""gguf-q8's int8 kernel for several activation rows: the row-at-a-time register tiles on the blocks as
loaded (`block_quant.matmul_q8`) against the tiles on the weight repacked into panels of eight
interleaved rows (`block_quant.matmul_q8_panels`), the two taking turns pass by pass in one run.

    .venv/bin/python benchmarks/bench_int8_panels.py [--rows 1,16,64,256] [--repeats 9] [--threads 1]

Shapes and types: the linear layers of SmolLM2-135M-Instruct Q4_1 (qkv, o, gate_up, down) and of
Qwen2.5-Coder-0.5B Q4_K_M that take panels (qkv in Q8_0 as its v is, o and gate_up in Q5_0; its down
is Q6_K, blocks of 16: no panels), random blocks as the tests build them. Medians of --repeats passes
over all of a model's layers; G MAC/s = weights x rows / time, summed over them. At one row the
blocks run their one-row kernel, which one-row steps keep (they do not take panels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_quantization import random_gguf_tensor  # noqa: E402  (the tests' block builder)

from tokenmill.kernels import block_quant  # noqa: E402
from tokenmill.layers.linear import ReplicatedLinear  # noqa: E402
from tokenmill.quantization.gguf import GGUFConfig  # noqa: E402

# (type, rows, columns) of the layers
SHAPES = {
    "SmolLM2-135M": [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)],
    "Qwen2.5-0.5B": [("Q8_0", 1152, 896), ("Q5_0", 896, 896), ("Q5_0", 9728, 896)],
}


def layer_of(qtype: str, n: int, k: int) -> ReplicatedLinear:
    weight, _ = random_gguf_tensor(qtype, n, k, np.random.default_rng(0))
    layer = ReplicatedLinear(k, n, quant_config=GGUFConfig({"w.weight": qtype}, int8_activations=True), prefix="w")
    layer.weight_loader("weight", weight)
    layer.quant_method.process_after_loading(layer)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256", help="activation rows per call (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="timed passes (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {torch.get_num_threads()} threads; G MAC/s of the blocks' tiles, the panels' tiles, and their ratio")
    print(f"{'model':14s} {'rows':>5s} {'blocks':>8s} {'panels':>8s} {'ratio':>6s}")
    for model, shapes in SHAPES.items():
        layers = [layer_of(qtype, n, k) for qtype, n, k in shapes]
        macs = sum(n * k for _, n, k in shapes)
        for rows in map(int, args.rows.split(",")):
            xs = [torch.randn(rows, k) for _, _, k in shapes]
            calls = [
                lambda x, layer: block_quant.matmul_q8(x, layer.quant_method.blocks(layer)),
                lambda x, layer: block_quant.matmul_q8_panels(x, layer.panels),
            ]
            times = [[], []]
            for _ in range(args.repeats + 1):  # the first pass warms up; the kernels take turns
                for call, own in zip(calls, times):
                    start = time.perf_counter()
                    for x, layer in zip(xs, layers):
                        call(x, layer)
                    own.append(time.perf_counter() - start)
            old, new = (statistics.median(t[1:]) for t in times)
            rate = macs * rows / 1e9
            print(f"{model:14s} {rows:5d} {rate / old:8.1f} {rate / new:8.1f} {old / new:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
