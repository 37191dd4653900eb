"""gguf-q8's int8 kernel for several activation rows, per linear layer of a model: the row-at-a-time
register tiles on the blocks as loaded (`block_quant.matmul_q8`), the tiles on the weight repacked into
panels of eight interleaved rows (`block_quant.matmul_q8_panels`), and dequantize + float32 GEMM on the
rounded activations (what steps past a layer's `max_tokens` run), taking turns pass by pass in one run.

    .venv/bin/python benchmarks/bench_int8_panels.py [--rows 1,16,64,256] [--repeats 9] [--threads 1]

Shapes and types: the linear layers of SmolLM2-135M-Instruct Q4_1 (qkv, o, gate_up, down) and of
Qwen2.5-Coder-0.5B Q4_K_M (qkv in Q8_0 as its v is in half the layers, else Q5_0; o and gate_up in
Q5_0; down in Q4_K in half the layers, Q6_K in the others; the LM head in Q8_0), random blocks as the
tests build them (`--layers lm_head` alone: the LM head's 145 MB take a while to build).
Medians of --repeats passes; G MAC/s = weights x rows / time ("-": no panels for that type). `step`
names the kernel a step of that many rows runs (`BlockQuantLinearMethod.apply`). At one row the
blocks run their one-row kernel. A layer's weights stay in cache from pass to pass unless --copies N
gives each call N copies in turn (past the L3: from memory, as a model's layers come).
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

# (layer, type, rows, columns) of the layers
SHAPES = {
    "SmolLM2-135M": [
        ("qkv", "Q4_1", 960, 576),
        ("o", "Q4_1", 576, 576),
        ("gate_up", "Q4_1", 3072, 576),
        ("down", "Q4_1", 576, 1536),
        ("lm_head", "Q8_0", 49152, 576),  # token_embd.weight, tied: the batch-16 decode steps' LM head
    ],
    "Qwen2.5-0.5B": [
        ("qkv", "Q8_0", 1152, 896),
        ("qkv", "Q5_0", 1152, 896),
        ("o", "Q5_0", 896, 896),
        ("gate_up", "Q5_0", 9728, 896),
        ("down", "Q4_K", 896, 4864),
        ("down", "Q6_K", 896, 4864),
        ("lm_head", "Q8_0", 151936, 896),  # output.weight: every decode step's rows against 136 M weights
    ],
}


def layer_of(qtype: str, n: int, k: int) -> ReplicatedLinear:
    weight, _ = random_gguf_tensor(qtype, n, k, np.random.default_rng(0))
    layer = ReplicatedLinear(k, n, quant_config=GGUFConfig({"w.weight": qtype}, int8_activations=True), prefix="w")
    layer.weight_loader("weight", weight)
    layer.quant_method.process_after_loading(layer)
    return layer


def gemm(x: torch.Tensor, layer: ReplicatedLinear) -> torch.Tensor:
    """Dequantize + float32 GEMM on the rounded activations (the large-step path without AMX)."""
    w = layer.quant_method.blocks(layer)
    weight = block_quant.dequantize(w, out=block_quant.workspace(*w.shape))
    return block_quant.round_activations(x, w.activation_span) @ weight.t()


def step_kernel(layer: ReplicatedLinear, rows: int) -> str:
    limit = layer.quant_method.max_tokens(layer)
    if limit is not None and rows > limit:
        return "gemm"
    return "panels" if layer.panels is not None else "blocks"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256", help="activation rows per call (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="timed passes (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--types", help="only the layers of these comma-separated GGUF types (default: all)")
    ap.add_argument("--layers", help="only these comma-separated layers, e.g. gate_up,lm_head (default: all)")
    ap.add_argument("--copies", type=int, default=1, help="copies of each weight a call runs through (default: 1)")
    ap.add_argument("--kernels", default="blocks,panels,gemm", help="only these of the three (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {torch.get_num_threads()} threads; G MAC/s of the blocks' tiles, the panels' tiles, dequantize + GEMM")
    print(f"{'model':14s} {'layer':8s} {'type':5s} {'rows':>5s} {'blocks':>7s} {'panels':>7s} {'gemm':>7s}  step")
    for model in args.models.split(","):
        for name, qtype, n, k in SHAPES[model]:
            if args.types and qtype not in args.types.split(","):
                continue
            if args.layers and name not in args.layers.split(","):
                continue
            layers = [layer_of(qtype, n, k) for _ in range(args.copies)]
            layer = layers[0]
            blocks = [each.quant_method.blocks(each) for each in layers]
            calls = {
                "blocks": lambda x: [block_quant.matmul_q8(x, w) for w in blocks],
                "panels": (lambda x: [block_quant.matmul_q8_panels(x, each.panels) for each in layers])
                if layer.panels
                else None,
                "gemm": lambda x: [gemm(x, each) for each in layers],
            }
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
                times = {kind: [] for kind, call in calls.items() if call is not None and kind in args.kernels}
                for _ in range(args.repeats + 1):  # the first pass warms up; the kernels take turns
                    for kind in times:
                        start = time.perf_counter()
                        calls[kind](x)
                        times[kind].append(time.perf_counter() - start)
                rate = {kind: args.copies * n * k * rows / statistics.median(t[1:]) / 1e9 for kind, t in times.items()}
                cells = " ".join(f"{rate[kind]:7.1f}" if kind in rate else f"{'-':>7s}" for kind in calls)
                print(f"{model:14s} {name:8s} {qtype:5s} {rows:5d} {cells}  {step_kernel(layer, rows)}", flush=True)


if __name__ == "__main__":
    main()
