"""CPU float32 compute: decode reads K/V straight from the blocks with a compiled kernel (no gather copy,
no padding; sliding windows, soft-caps, sinks and latent MLA caches too; float32, float16 or bfloat16 caches,
and int8 / fp8 ones with their scales, dequantized as they are read), and the step's K/V are written
in one call (a quantized cache: by a C++ quantizer that gives the torch path's bytes); a short chunk after cached tokens (a
speculative verify step) runs as one decode per new token over the same blocks; other prompt chunks
run the compiled prefill kernel over the blocks, the chunk's own K/V included once written: every chunk
of a prompt reads the same stored values, wherever the scheduler cut it (in the exact mode, a float32
cache, those are the computed values themselves), except a quantized cache's first chunk (below)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.metadata import CommonAttentionMetadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import paged_attention

SHORT_CHUNK = 16  # new tokens up to which a chunk after cached ones runs as per-token decodes


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu-paged"
    needs_decode_mask = False

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        if v is None or k.stride(-1) != 1 or v.stride(-1) != 1:
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        elif kv_scales is not None:
            paged_attention.write_kv_quantized(k, v, k_cache, v_cache, kv_scales, slot_mapping)
        else:
            paged_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def build_metadata(self, common: CommonAttentionMetadata, sliding_window: int | None = None):
        """When every chunk of the step is short and follows cached tokens (decodes and speculative
        verify steps), every new token becomes a decode row of its own: the step then runs as one
        decode batch (and the compiled decode step applies)."""
        d = common.num_decodes
        new = np.diff(common.query_start_loc)[d:]
        if d == common.num_reqs or new.max() > SHORT_CHUNK or not common.num_computed_tokens[d:].all():
            meta = super().build_metadata(common, sliding_window)
            for i, p in enumerate(meta.prefills, d):  # a first chunk too reads its K/V from its blocks
                if p.block_table is None:
                    blocks = (p.end - p.start + common.block_size - 1) // common.block_size
                    p.block_table = torch.from_numpy(common.block_table[i, :blocks].copy())
            return meta
        req = np.repeat(np.arange(common.num_reqs), np.diff(common.query_start_loc))
        positions = np.arange(len(req)) - common.query_start_loc[req] + common.num_computed_tokens[req]
        rows = CommonAttentionMetadata(
            len(req),
            np.arange(len(req) + 1),
            positions,
            positions + 1,
            common.block_table[req],
            common.slot_mapping,
            common.block_size,
            common.device,
        )
        return super().build_metadata(rows, sliding_window)

    @staticmethod
    def runs_prefill_kernel(p, quantized: bool) -> bool:
        """Whether `_prefill` runs chunk p with the prefill kernel over the cache alone (not as per-token
        decodes, not with its own K/V beside a quantized cache): what the compiled step runs in its place."""
        return (
            p.block_table is not None
            and not (p.cached and p.end - p.start <= SHORT_CHUNK)
            and not (quantized and not p.cached)
        )

    def _prefill(self, q, k, v, k_cache, v_cache, p, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        """A short chunk after cached tokens (a speculative verify step, a small prompt chunk): each new
        token is a decode of its own over the same blocks, with its own context length; any other chunk:
        the prefill kernel over the blocks. A quantized cache's first chunk attends its own K/V as computed,
        as the torch path does (read back from int8 / fp8, the chunk's rows cost measurable quality:
        test_kv_cache_quant's greedy agreement with a float32 cache)."""
        n = p.end - p.start
        if p.cached and n <= SHORT_CHUNK:
            lens = torch.arange(p.cached + 1, p.cached + n + 1, device=q.device)
            tables = p.block_table[None].expand(n, -1).contiguous()
            return paged_attention.paged_decode_attention(
                q[p.start : p.end].contiguous(),
                k_cache,
                v_cache,
                tables,
                lens,
                scale,
                meta.sliding_window,
                soft_cap,
                kv_scales,
                sinks,
            )
        return paged_attention.paged_prefill_attention(
            q[p.start : p.end],
            k_cache,
            v_cache,
            p.block_table,
            p.cached,
            scale,
            meta.sliding_window,
            soft_cap,
            kv_scales,
            sinks,
            None if kv_scales is None or p.cached else (k[p.start : p.end], v[p.start : p.end]),
        )

    def _decode(self, q, k_cache, v_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        return paged_attention.paged_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.sliding_window,
            soft_cap,
            kv_scales,
            sinks,
        )
