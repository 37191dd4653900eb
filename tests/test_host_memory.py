"""CPU tensors on transparent huge pages (`tokenmill/kernels/host_memory.py`): the repacked weights and
the CPU KV cache are allocated there."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from tokenmill.kernels import block_quant, host_memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _mapping_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds t's first byte (/proc/self/smaps)."""
    return _mapping_flags_at(t.data_ptr())


def _mapping_flags_at(address: int) -> list[str]:
    flags = _flags_of_mapping_at(address)
    if flags is None:
        raise AssertionError("no mapping holds the tensor")
    return flags


def _flags_of_mapping_at(address: int) -> list[str] | None:
    """The VmFlags of the mapping that holds `address`, None where none does."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_pieces_are_zeroed_aligned_and_apart():
    pieces = [host_memory.zeros((n, 3), dt) for n, dt in [(5, torch.float16), (1, torch.uint8), (700, torch.float32)]]
    for p, dt in zip(pieces, (torch.float16, torch.uint8, torch.float32)):
        assert p.dtype == dt and p.is_contiguous() and p.data_ptr() % 64 == 0
        assert not p.any()
    for i, p in enumerate(pieces):  # writing one leaves the others as they were
        p.fill_(i + 1)
    assert [int(p.unique().item()) for p in pieces] == [1, 2, 3]
    empty = host_memory.zeros((0, 4), torch.float32)
    assert empty.shape == (0, 4)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]", "never"),
    ],
)
def test_mode_reads_the_kernels_setting(tmp_path, text, expected):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert host_memory.mode(setting) == expected
    assert host_memory.mode(tmp_path / "missing") == "unknown"


def test_copy_holds_the_values():
    t = torch.randn(33, 17).half()
    c = host_memory.copy(t)
    assert c.dtype == t.dtype and torch.equal(c, t) and c.data_ptr() != t.data_ptr()


@linux
@pytest.mark.parametrize("nbytes", [4096, host_memory.CHUNK])  # a shared region's piece and a region of its own
def test_the_memory_is_advised_to_take_huge_pages(nbytes):
    t = host_memory.zeros((nbytes,), torch.uint8)
    assert "hg" in _mapping_flags(t)  # madvise(MADV_HUGEPAGE) applied; the kernel decides the rest
    # the check tells the two apart: a mapping of the same kind, not advised (not a malloc'd tensor, whose
    # heap memory numpy, for one, may have advised for an array freed before)
    plain = torch.frombuffer(mmap.mmap(-1, 1 << 22, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    assert "hg" not in _mapping_flags(plain)


@linux
def test_a_region_goes_back_to_the_kernel_with_its_last_tensor():
    """A region is a mapping of its own, unmapped once its last tensor is freed: not malloc's memory, which
    malloc hands out again, the huge-page advice still on it, to any later allocation (the first version's
    regions came from malloc, and a plain tensor later landed on advised heap memory)."""
    threshold_raiser = torch.empty(30 << 20, dtype=torch.uint8)  # freed: glibc serves up to 30 MiB from its heap
    del threshold_raiser
    region = host_memory.zeros((9 << 20,), torch.uint8)  # a region of its own
    view = region[100:200]
    address = region.data_ptr()
    del region
    assert "hg" in _mapping_flags(view)  # alive while a view of it is
    del view
    # unmapped; another thread of this process may have mapped something there since, but not advised
    later = _flags_of_mapping_at(address)
    assert later is None or "hg" not in later, later


@linux
def test_repacked_panels_are_on_advised_memory():
    if block_quant.load() is None:
        pytest.skip("no compiled kernels")
    n, k = 64, 256  # 4-bit codes (two a byte) with offsets, as Q4_1's
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales, offsets = torch.rand(n, k // 32).half(), -torch.rand(n, k // 32).half()
    w = block_quant.Blocks(codes, None, scales, offsets, None, bits=4, center=0)
    panels = block_quant.repack_panels(w)
    assert "hg" in _mapping_flags(panels.codes) and "hg" in _mapping_flags(panels.scales)
    x = torch.randn(3, k)
    assert torch.allclose(block_quant.matmul_q8_panels(x, panels), block_quant.matmul_q8(x, w), rtol=1e-5, atol=1e-5)
