"""CPU tensors on transparent huge pages, for what a decode step streams from memory every token: the
repacked weights and the KV cache. On 4 KiB pages that stream takes a TLB miss every 4 KiB, and on a
virtual machine each miss walks two page tables; this project's 2-vCPU host read a 100 MB buffer at 26
GB/s on 4 KiB pages and at 32 on 2 MiB ones (two threads; one thread: 17 and 29), and a single-stream
SmolLM2 decode ran 1.11x faster with its weights on huge pages (BENCHMARKS.md).

A layer's repacked weights are tensors of 0.1-1 MB, below the 2 MiB a huge page maps, so they are carved
out of shared chunks (`zeros`, `copy`); a tensor of a quarter chunk or more gets a region of its own. Each
region is an anonymous mapping of its own (not malloc's memory, which malloc hands out again once freed),
aligned to 2 MiB and marked with madvise(MADV_HUGEPAGE) before its pages are first touched, so
the kernel backs them with huge pages where transparent huge pages are `always` or `madvise` (`never`:
4 KiB pages, as plain tensors). Off Linux these are plain tensors.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
CHUNK = 32 << 20  # bytes a shared region holds
_ALIGN = 64  # a cache line: every tensor starts on one
_ADVISABLE = hasattr(mmap, "MADV_HUGEPAGE")  # Linux's


def mode(setting: Path = THP_SETTING) -> str:
    """This kernel's transparent huge pages setting: `always`, `madvise` (both back these tensors with huge
    pages), `never`, or `unknown` (no such setting: not Linux, or a kernel without them)."""
    try:
        text = setting.read_text()
    except OSError:
        return "unknown"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen or "unknown"


def _region(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a huge page, its whole huge pages advised before any is touched.

    The region is a mapping of its own, never malloc's: malloc may hand out freed memory of its heap, and
    advice given there would outlive the region on whatever malloc puts in that memory next. The mapping
    goes back to the kernel when the last tensor on it is freed."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, untouched pages
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
        except OSError:  # advice, not a requirement: a kernel without transparent huge pages keeps 4 KiB
            pass
    return raw[start : start + nbytes]


class _Chunks:
    """Hands out cache-line-aligned pieces of the current shared region, opening another when it is full.
    A region lives while any tensor cut from it does."""

    def __init__(self) -> None:
        self.region: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes >= CHUNK // 4:
            return _region(nbytes)
        if self.region is None or self.used + nbytes > CHUNK:
            self.region, self.used = _region(CHUNK), 0
        piece = self.region[self.used : self.used + nbytes]
        self.used = -(-(self.used + nbytes) // _ALIGN) * _ALIGN
        return piece


_chunks = _Chunks()


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages (a plain one off Linux)."""
    if not _ADVISABLE:
        return torch.zeros(shape, dtype=dtype)
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    return _chunks.take(max(nbytes, 1))[:nbytes].view(dtype).view(shape).zero_()


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` on huge pages."""
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
