"""The int8 panel kernels of several builds of the C++ kernels in one process, taking turns call by
call, on the layers of `bench_int8_panels.py`: a kernel change measured against the commit before it
where the host's speed drifts (a shared machine), and each build's outputs checked to be the same bits.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_panel_builds.py --builds BEFORE.so,AFTER.so
        [--rows 1,16,256] [--layers qkv,o,gate_up,down,lm_head] [--types Q5_0,Q8_0] [--copies 1]

A build is an extension module file: the prebuilt `tokenmill/kernels/_cpu_*.so` of a checkout, or one
that `tokenmill.kernels` built from changed sources into ~/.cache/tokenmill/kernels. Each build repacks
the same blocks into its own panel layout. Q6_K's panels (their scales are the file's bytes) are left
out. G MAC/s: medians of --repeats passes; the ratio is the last build's over the first's.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_int8_panels import SHAPES, layer_of  # noqa: E402


def load_build(path: str):
    """The extension module in `path`, under its own name (builds load side by side)."""
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repack(build, w, panels):
    """`w`'s panels as `build` lays them out: codes of the size its repack accepts, the scales as `panels`'."""
    count, blocks = panels.codes.shape[:2]
    for size in sorted({panels.codes.shape[2], 128, 160, 256}):
        codes, scales = torch.zeros(count, blocks, size, dtype=torch.uint8), torch.zeros(count, blocks, 2, 8)
        try:
            build.block_quant_repack_panels(*w.args(), codes, scales)
        except RuntimeError:  # panels of other sizes
            continue
        return codes, scales.to(panels.scales.dtype)
    raise ValueError("no panel size fits")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", required=True, help="comma-separated extension module files, the baseline first")
    ap.add_argument("--model", default="Qwen2.5-0.5B", choices=list(SHAPES), help="(default: %(default)s)")
    ap.add_argument("--rows", default="1,16,256", help="activation rows per call (default: %(default)s)")
    ap.add_argument("--layers", default="qkv,o,gate_up,down", help="(default: %(default)s)")
    ap.add_argument("--types", default="Q4_1,Q5_0,Q8_0,Q4_K", help="(default: %(default)s)")
    ap.add_argument("--copies", type=int, default=1, help="copies of each weight a call runs through (default: 1)")
    ap.add_argument("--repeats", type=int, default=11, help="timed passes (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builds = [load_build(path) for path in args.builds.split(",")]
    print(f"# {args.threads} threads, {args.copies} copies; G MAC/s of", ", ".join(b.__name__ for b in builds))
    for name, qtype, n, k in SHAPES[args.model]:
        if name not in args.layers.split(",") or qtype not in args.types.split(","):
            continue
        layer = layer_of(qtype, n, k)
        w = layer.quant_method.blocks(layer)
        packs = [[repack(build, w, layer.panels) for _ in range(args.copies)] for build in builds]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            outs = [torch.empty(rows, n) for _ in builds]
            times = [[] for _ in builds]
            for _ in range(args.repeats + 1):  # the first pass warms up
                for i, build in enumerate(builds):
                    start = time.perf_counter()
                    for codes, scales in packs[i]:
                        build.block_quant_matmul_q8_panels(x, codes, scales, w.bits, w.activation_span, outs[i])
                    times[i].append(time.perf_counter() - start)
            rates = [args.copies * n * k * rows / statistics.median(t[1:]) / 1e9 for t in times]
            same = all(torch.equal(outs[0], out) for out in outs[1:])
            cells = " ".join(f"{rate:7.1f}" for rate in rates)
            print(f"{name:8s} {qtype:5s} {rows:5d} {cells}  {rates[-1] / rates[0]:.2f}x  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
