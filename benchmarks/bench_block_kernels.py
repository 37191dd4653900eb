"""The block-quantized matmul kernels on one weight shape, per GGUF type: time per call and weights/s,
optionally against the kernels of an earlier git revision built side by side (same weights, same run).

    .venv/bin/python benchmarks/bench_block_kernels.py [--types Q4_K,Q5_0,Q6_K,Q8_0] [--shape 17920x1536]
        [--rows 1[,16,...]] [--copies 12] [--mode q8|float] [--against REV]

Random blocks of each type (as the tests build them) packed as `tokenmill.quantization.gguf` packs
them for gguf-q8 (`--mode q8`, int8 activations) or the exact mode (`--mode float`). FP4 types:
`MXFP4`, `NVFP4` (a random weight quantized on load: e2m1 nibbles; E8M0 / e4m3 scale bytes) and
`MXFP4-5b`, `NVFP4-6b` (the same codes in the 5- / 6-bit integer layouts the kernels held them in
before the nibble table; float32 scales; the exact mode widened those to 8 bits), `NVFP4-f32` (the
nibbles with float32 scales, as NVFP4 was held before its e4m3 scale bytes). Without --against, FP4 types take turns
with each other pass by pass (compare them within one run). `--copies`
weights are cycled so that each call reads its weight from memory, as a decode step does (one copy:
from cache). Medians of --repeats passes over all copies. `--against REV`: the same calls on the
kernels of `git show REV:csrc/block_quant.cpp` (with this tree's other sources), and the
ratio; `--rows` then also reports the float32 GEMM on the dequantized weight (what larger steps ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_quantization import random_gguf_tensor  # noqa: E402  (the tests' block builder)

from tokenmill import kernels  # noqa: E402
from tokenmill.kernels import block_quant  # noqa: E402
from tokenmill.layers.fused_moe import ExpertProjection  # noqa: E402
from tokenmill.layers.linear import ReplicatedLinear  # noqa: E402
from tokenmill.quantization import fp4  # noqa: E402
from tokenmill.quantization.gguf import BlockLayout, BlockQuantLinearMethod, GGUFConfig  # noqa: E402

# FP4 in the integer layouts that hold codes -12..12: 5 bits (center 16) per 32, 6 bits (center 32) per 16;
# and NVFP4's nibbles with float32 scales
FP4_FORMER_LAYOUTS = {
    "MXFP4-5b": BlockLayout(5, 32, False, 16),
    "NVFP4-6b": BlockLayout(6, 16, False, 32),
    "NVFP4-f32": BlockLayout(block_quant.E2M1_CODES, 16, False, 12),
}


def fp4_blocks(qtype: str, n: int, k: int, int8_activations: bool) -> block_quant.Blocks:
    """A random weight in FP4 type `qtype` (see the module docstring), as the kernels take it."""
    method_name = qtype.split("-")[0].lower()
    w = torch.from_numpy(np.random.default_rng(0).normal(0, 0.05, (n, k)).astype(np.float32))
    if qtype in FP4_FORMER_LAYOUTS:
        method = BlockQuantLinearMethod(FP4_FORMER_LAYOUTS[qtype], int8_activations, half=False)
    else:
        method = fp4.FP4LinearMethod(method_name, int8_activations)
    module = ExpertProjection(method, n, k, "w")
    codes = fp4.quantize(w, method_name)
    method.write(
        module,
        dataclasses.replace(codes, bits=method.bits, center=method.layout.center)
        if qtype in FP4_FORMER_LAYOUTS
        else codes,
        slice(None),
    )
    return method.blocks(module)


def kernels_at(rev: str):
    """The CPU extension with csrc/block_quant.cpp as it was at git revision `rev` (this tree's other sources),
    built from source for this CPU."""
    build = Path(tempfile.mkdtemp(prefix="tokenmill-csrc-"))
    shutil.copytree(ROOT / "csrc", build, dirs_exist_ok=True)
    (build / "block_quant.cpp").write_text(
        subprocess.check_output(["git", "show", f"{rev}:csrc/block_quant.cpp"], cwd=ROOT, text=True)
    )
    return kernels.build_from_source(build, "native", name=f"cpu_at_{rev}")


def median_times(calls, copies, x, out, repeats: int) -> list[float]:
    """Median time per call of each of `calls` over `repeats` passes through all copies (one list for
    all calls, or one per call); the calls take turns pass by pass, so that a drift in the host's
    bandwidth hits them alike."""
    times = [[] for _ in calls]
    per_call = copies if isinstance(copies[0], list) else [copies] * len(calls)
    for _ in range(repeats + 1):  # the first pass warms up
        for call, own, weights in zip(calls, times, per_call):
            start = time.perf_counter()
            for w in weights:
                call(x, *w.args(), out)
            own.append((time.perf_counter() - start) / len(copies))
    return [statistics.median(own[1:]) for own in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0", help="comma-separated GGUF types (default: %(default)s)")
    ap.add_argument("--shape", default="17920x1536", help="weight rows x columns (default: %(default)s)")
    ap.add_argument("--rows", default="1", help="activation rows per call, comma-separated (default: %(default)s)")
    ap.add_argument("--copies", type=int, default=12, help="weights cycled through (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="passes over all copies (default: %(default)s)")
    ap.add_argument("--mode", choices=["q8", "float"], default="q8", help="q8: gguf-q8 (default); float: exact mode")
    ap.add_argument("--against", metavar="REV", help="also time the kernels of this git revision")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    name = "block_quant_matmul_q8" if args.mode == "q8" else "block_quant_matmul"
    builds = [("now", block_quant.load())] + ([(args.against, kernels_at(args.against))] if args.against else [])
    print(
        f"# {args.mode} kernel, {n}x{k}, {args.copies} copies, {torch.get_num_threads()} threads; G MAC/s = "
        "weights x rows / time"
    )
    head = f"{'type':8s} {'rows':>5s} " + " ".join(f"{label + ' us':>12s} {'G MAC/s':>8s}" for label, _ in builds)
    print(head + ("  ratio  GEMM us  G MAC/s" if args.against else "  GB/s"))
    types = args.types.split(",")
    if not args.against and all("FP4" in t for t in types):  # the FP4 layouts take turns
        copies = {t: [fp4_blocks(t, n, k, args.mode == "q8") for _ in range(args.copies)] for t in types}
        for rows in map(int, args.rows.split(",")):
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            calls = [getattr(block_quant.load(), name)] * len(types)
            for t, time_ in zip(types, median_times(calls, [copies[t] for t in types], x, out, args.repeats)):
                nbytes = sum(a.numel() * a.element_size() for a in copies[t][0].args()[:5] if a is not None)
                print(
                    f"{t:8s} {rows:5d} {time_ * 1e6:12.0f} {n * k * rows / time_ / 1e9:8.1f}  "
                    f"{nbytes / time_ / 1e9:5.1f}",
                    flush=True,
                )
        return
    for qtype in types:
        copies = []
        if "FP4" in qtype:
            copies = [fp4_blocks(qtype, n, k, args.mode == "q8") for _ in range(args.copies)]
        else:
            weight, _ = random_gguf_tensor(qtype, n, k, np.random.default_rng(0))
            config = GGUFConfig({"w.weight": qtype}, int8_activations=args.mode == "q8")
        for _ in range(args.copies if not copies else 0):
            layer = ReplicatedLinear(k, n, quant_config=config, prefix="w")
            layer.weight_loader("weight", weight)
            copies.append(layer.quant_method.blocks(layer))
        nbytes = sum(t.numel() * t.element_size() for t in copies[0].args()[:5] if t is not None)
        for rows in map(int, args.rows.split(",")):
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            times = median_times([getattr(ext, name) for _, ext in builds], copies, x, out, args.repeats)
            line = f"{qtype:8s} {rows:5d} " + " ".join(f"{t * 1e6:12.0f} {n * k * rows / t / 1e9:8.1f}" for t in times)
            if args.against:
                dense = block_quant.workspace(n, k)

                def gemm(xx, *w_args):  # what steps past the fused kernel's limit ran: dequantize, then GEMM
                    block_quant.load().block_quant_dequantize(*w_args[:8], dense)
                    return xx @ dense.t()

                (g,) = median_times([gemm], copies, x, out, max(1, args.repeats // 3))
                line += f"  {times[1] / times[0]:5.2f}x {g * 1e6:8.0f} {n * k * rows / g / 1e9:8.1f}"
            else:
                line += f"  {nbytes / times[0] / 1e9:5.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
