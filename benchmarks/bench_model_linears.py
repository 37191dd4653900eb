"""Where a decode step's weight reads go: every linear layer of a real model at one activation row,
in model order (so each call reads its weights from memory, as a decode step does), grouped by layer
kind and shape: time per token and the bandwidth reached against the bytes held.

    .venv/bin/python benchmarks/bench_model_linears.py [--model qwen2.5-coder-1.5b] [--passes 5]

--model: a GGUF path or a ../shared/models/fetch.sh name; the default weight format (gguf-q8 on CPU).
Medians over --passes passes after one warm-up pass. Compare kinds within one run: this host's
bandwidth moves by tens of percent between runs.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def model_path(name: str) -> str:
    if name.endswith(".gguf"):
        return name
    out = subprocess.run(
        ["bash", str(ROOT.parent / "shared" / "models" / "fetch.sh"), name], check=True, capture_output=True, text=True
    ).stdout
    return out.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="GGUF path or fetch.sh name (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=5, help="timed passes over the model (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    args = ap.parse_args()
    from tokenmill.layers.linear import LinearBase
    from tokenmill.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(model_path(args.model))
    linears = [m for m in loaded.model.modules() if isinstance(m, LinearBase)]
    inputs = [torch.randn(1, m.input_size_per_partition) for m in linears]
    kinds = [
        f"{m.prefix.rsplit('.', 1)[-1]} {sum(m.output_partition_sizes)}x{m.input_size_per_partition} "
        f"{getattr(m.quant_method, 'bits', 32)}-bit"
        for m in linears
    ]
    nbytes = collections.Counter()
    for m, kind in zip(linears, kinds):
        nbytes[kind] += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False) if b is not None)
    passes = []
    with torch.inference_mode():
        for _ in range(args.passes + 1):
            times = collections.Counter()
            for m, x, kind in zip(linears, inputs, kinds):
                start = time.perf_counter()
                m.quant_method.apply(m, x, None)
                times[kind] += time.perf_counter() - start
            passes.append(times)
    median = {kind: statistics.median(p[kind] for p in passes[1:]) for kind in nbytes}
    print(f"# {Path(loaded.source.path).name}, weights {loaded.quantization}, {args.threads} threads, one row")
    print(f"{'layer kind':40s} {'ms/token':>9s} {'MB':>8s} {'GB/s':>6s}")
    for kind in sorted(median, key=lambda k: -median[k]):
        print(
            f"{kind:40s} {median[kind] * 1e3:9.2f} {nbytes[kind] / 1e6:8.1f} {nbytes[kind] / median[kind] / 1e9:6.1f}"
        )
    total, size = sum(median.values()), sum(nbytes.values())
    print(f"{'all':40s} {total * 1e3:9.2f} {size / 1e6:8.1f} {size / total / 1e9:6.1f}")


if __name__ == "__main__":
    main()
