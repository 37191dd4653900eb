"""Where a loaded model's weights live: bytes used straight from a memory map of the checkpoint files
(no copy) and bytes the loader copied or repacked into memory of its own, and the process's resident
memory. `tokenmill info --load` prints it.

A tensor counts as mapped when its storage lies inside one of this process's file mappings of the
checkpoint (read from /proc/self/maps through psutil). Mapped: safetensors tensors and GGUF F32 /
F16 / BF16 tensors that a parameter uses as is (`quantization.unquantized.load_dense`: whole, in the
run's dtype, on the CPU). Copied: fused layers (QKV, gate/up), tensor-parallel slices, dtype
conversions, and every GGUF quantized tensor (its blocks are unpacked into the kernels' codes /
scales layout; no kernel reads ggml's block layout as stored). Resident memory counts the mapped
weights' file pages once they are read; `rss_file` is that share (clean pages of the checkpoint the
kernel can drop and read again, unlike the copies).
"""

from __future__ import annotations

from pathlib import Path

import psutil


def _storages(model) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage of the model's parameters and buffers."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return seen


def weight_residency(loaded) -> dict[str, int]:
    """{"mapped": bytes used from a checkpoint map, "copied": bytes in memory of their own, "file":
    the checkpoint's bytes, "rss": this process's resident bytes, "rss_file": the part that is pages of
    the checkpoint's maps}."""
    root = Path(loaded.source.path)
    files = {str(p.resolve()) for p in ([root] if root.is_file() else root.iterdir())}
    ranges, rss_file = [], 0
    for m in psutil.Process().memory_maps(grouped=False):
        if m.path in files:
            start, end = (int(a, 16) for a in m.addr.split("-"))
            ranges.append((start, end))
            rss_file += m.rss
    mapped = copied = 0
    for ptr, size in _storages(loaded.model).items():
        if any(start <= ptr < end for start, end in ranges):
            mapped += size
        else:
            copied += size
    file_bytes = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
    rss = psutil.Process().memory_info().rss
    return {"mapped": mapped, "copied": copied, "file": file_bytes, "rss": rss, "rss_file": rss_file}
