"""The GPU backend: paged attention in Triton (`kernels/triton_paged_attention.py`) for every token of a
step, decodes and prompt chunks (with prefix hits) alike, straight from the blocks: no gather copy, no
mask tensor, no padding to the longest context; sliding windows, soft-caps, sinks, latent (MLA) caches and
int8 / fp8 caches in the kernel. Layers that rotate their queries and keys (`forward_rotary`) have the
rotation and the cache write done by one kernel (`kernels/triton_rotary_kv.py`), int8 / fp8 caches
quantized in it; other new K/V (a latent cache's) are written by the KV-write kernel, or by torch ops.

The step's integer metadata (query offsets, lengths, block table, the kernel's tile map) travels to the
device in the step's one copy, with its token ids, positions and slots (`StepInputs`: one persistent
staging buffer, pinned on CUDA, one copy without blocking), as views of one device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.metadata import CommonAttentionMetadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import triton_paged_attention as kernel
from tokenmill.kernels import triton_rotary_kv


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    block_table: torch.Tensor  # [B, blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    tile_req: torch.Tensor  # [tiles] int32: the kernel's tiles of query tokens
    tile_start: torch.Tensor  # [tiles] int32
    block_m: int  # query tokens per tile
    num_splits: int  # slices of the key length per tile
    sliding_window: int | None = None


def upload(arrays: list[np.ndarray], common: CommonAttentionMetadata) -> list[torch.Tensor]:
    """Int arrays -> int32 tensors on the step's device: in the step's one copy with its inputs when the
    runner stages them (`common.stage`), else in one copy of their own (one packed host buffer, pinned on
    CUDA, copied without blocking: the host goes on building the step while it travels)."""
    if common.stage is not None:
        return common.stage(arrays, torch.int32)
    packed = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32))
    if common.device.type == "cuda":
        packed = packed.pin_memory().to(common.device, non_blocking=True)
    tensors, offset = [], 0
    for a in arrays:
        tensors.append(packed[offset : offset + a.size].view(a.shape))
        offset += a.size
    return tensors


def num_splits_for(num_tiles: int, max_seq_len: int, target_programs: int = 128, keys_per_split: int = 256) -> int:
    """Slices of the key length per tile: enough programs to fill the device when few tiles attend long
    contexts (a batch-1 decode), never slices shorter than `keys_per_split` keys."""
    return max(1, min(-(-max_seq_len // keys_per_split), target_programs // max(num_tiles, 1)))


class TritonPagedBackend(TorchSDPABackend):
    name = "triton-paged"
    supported_features = ("sliding_window", "logits_soft_cap", "sinks")

    def build_metadata(
        self, common: CommonAttentionMetadata, sliding_window: int | None = None
    ) -> TritonAttentionMetadata:
        qsl = common.query_start_loc
        new = np.diff(qsl)
        block_m = kernel.block_m_for(int(new.max()))
        tile_req, tile_start = kernel.query_tiles(qsl.tolist(), block_m)
        context = (
            int(common.seq_lens.max()) if sliding_window is None else min(int(common.seq_lens.max()), sliding_window)
        )
        table, qsl_d, lens, req, start = upload(
            [common.block_table, qsl, common.seq_lens, np.array(tile_req), np.array(tile_start)], common
        )
        return TritonAttentionMetadata(
            common.slot_mapping,
            table,
            qsl_d,
            lens,
            req,
            start,
            block_m,
            num_splits_for(len(tile_req), context),
            sliding_window,
        )

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        """A float cache by the Triton kernel (a negative slot, a CUDA graph's padding row, is skipped);
        a quantized one by the torch quantizer."""
        if kv_scales is not None or k.stride(-1) != 1 or (v is not None and v.stride(-1) != 1):
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        else:
            kernel.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, kv_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        k_cache, v_cache, kv_scales = self._store(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks)

    def forward_rotary(
        self, positions, rotary, qk, v, kv_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None
    ):
        """The rotation and the K/V write in one kernel (a separate K and V cache, rows of unit stride)."""
        if kv_cache.shape[0] != 2 or qk.stride(-1) != 1 or v.stride(-1) != 1:
            return super().forward_rotary(positions, rotary, qk, v, kv_cache, meta, scale, soft_cap, kv_scales, sinks)
        q = triton_rotary_kv.rotary_store(
            qk, v, positions, rotary.table(qk), rotary.rotary_dim, rotary.interleaved,
            kv_cache[0], kv_cache[1], meta.slot_mapping, kv_scales,
        )  # fmt: skip
        return self._attend(q, kv_cache[0], kv_cache[1], meta, scale, soft_cap, kv_scales, sinks)

    def _attend(self, q, k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks):
        return kernel.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            meta.tile_req,
            meta.tile_start,
            meta.block_m,
            scale,
            num_splits=meta.num_splits,
            sliding_window=meta.sliding_window,
            soft_cap=soft_cap,
            kv_scales=kv_scales,
            sinks=sinks,
        )
