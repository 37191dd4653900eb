"""CPU float32: decode reads K/V straight from the blocks with a compiled kernel (no gather copy,
no padding), and the step's K/V are written in one call; prompt chunks, and decodes of layers with a
sliding window or a soft-cap, use the torch path."""

from __future__ import annotations

from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import paged_attention


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu-paged"
    needs_decode_mask = False

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if k.stride(-1) == 1 and v.stride(-1) == 1:
            paged_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta, scale, soft_cap=None):
        if meta.sliding_window is not None or soft_cap is not None:  # the kernel sees every cached token
            return super()._decode(q, k_cache, v_cache, meta, scale, soft_cap)
        return paged_attention.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_context_lens, scale)
