"""Where a loaded model's weights live: bytes used straight from a memory map of the checkpoint files
(no copy) and bytes the loader copied or repacked into memory of its own, and the process's resident
memory. `tokenmill info --load` prints it.

A tensor counts as mapped when its storage lies inside one of this process's file mappings of the
checkpoint (read from /proc/self/maps through psutil). GGUF blocks are unpacked into the kernels'
codes / scales layout and dense layers are fused (QKV, gate/up) and placed per rank, so today's
loader copies every tensor and closes the map after loading; this counts what would change if a
format's tensors were used in place.
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
    the checkpoint's bytes, "rss": this process's resident bytes}."""
    root = Path(loaded.source.path)
    files = {str(p.resolve()) for p in ([root] if root.is_file() else root.iterdir())}
    ranges = []
    for m in psutil.Process().memory_maps(grouped=False):
        if m.path in files:
            start, end = (int(a, 16) for a in m.addr.split("-"))
            ranges.append((start, end))
    mapped = copied = 0
    for ptr, size in _storages(loaded.model).items():
        if any(start <= ptr < end for start, end in ranges):
            mapped += size
        else:
            copied += size
    file_bytes = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
    return {"mapped": mapped, "copied": copied, "file": file_bytes, "rss": psutil.Process().memory_info().rss}
