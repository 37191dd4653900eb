"""CPU float32 compute: decode reads K/V straight from the blocks with a compiled kernel (no gather copy,
no padding; sliding windows, soft-caps and latent MLA caches too; float32, float16 or bfloat16 caches),
and the step's K/V are written in one call; prompt chunks use the torch path."""

from __future__ import annotations

from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import paged_attention


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu-paged"
    needs_decode_mask = False

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if v is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
            paged_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta, scale, soft_cap=None):
        return paged_attention.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_context_lens, scale, meta.sliding_window, soft_cap)
