"""FlashAttention and FlashInfer as attention backends (`--attention-backend flash-attn|flashinfer`, CUDA
with the package installed: `config.check_attention_backend` refuses them at start otherwise). Both
read this project's paged cache as it is, [blocks, block_size, kv heads, head dim] per K and V (their
"NHD" paged layout), so they differ from `triton-paged` only in the attention call: the new K/V are
written by the Triton backend's kernels (the fused rotary + write included), and each turns the step's
description into its library's metadata here, once per step:

- flash-attn: `flash_attn_varlen_func` over the block table, queries ragged by `cu_seqlens_q` and keys
  by `cu_seqlens_k` (cumulative cached + new lengths), causal from the bottom right (a chunk's query i
  sees the keys up to its position), a window as (window - 1, 0), soft-cap. Its paged path takes blocks
  of a multiple of 256 tokens.
- flashinfer: a `BatchPrefillWithPagedKVCacheWrapper` (decodes are one-token prefills) planned with
  each request's pages as `kv_indptr` / `kv_indices` (the used blocks of its table, flattened) and the
  fill of its last page; planned once per step per window, on the first layer that attends.

Neither takes sinks, MLA latent caches or int8 / fp8 caches (refused when the runner is built), and
decode steps run eagerly (CUDA graphs capture the Triton backend only). Neither library is installed in
this project's CI: the metadata translation is tested as pure functions against what the Triton backend
builds, and the choice and refusals; the attention calls have not run here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.kv_quant import is_quantized
from tokenmill.attention.metadata import CommonAttentionMetadata
from tokenmill.attention.triton_paged import TritonPagedBackend, upload

FLASHINFER_WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashAttnMetadata:
    slot_mapping: torch.Tensor  # [T] long
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: each request's first new token in the flat batch
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: cumulative cached + new lengths
    block_table: torch.Tensor  # [B, blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int
    sliding_window: int | None = None


def flash_attn_metadata(common: CommonAttentionMetadata, sliding_window: int | None = None) -> FlashAttnMetadata:
    cu_k = np.zeros(common.num_reqs + 1, dtype=np.int64)
    np.cumsum(common.seq_lens, out=cu_k[1:])
    table, cu_q, cu_k = upload([common.block_table, common.query_start_loc, cu_k], common)
    return FlashAttnMetadata(
        common.slot_mapping,
        cu_q,
        cu_k,
        table,
        int(np.diff(common.query_start_loc).max()),
        int(common.seq_lens.max()),
        sliding_window,
    )


@dataclass
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # [T] long
    qo_indptr: torch.Tensor  # [B + 1] int32, on the host (the wrapper's plan reads it there)
    kv_indptr: torch.Tensor  # [B + 1] int32: each request's first page in kv_indices
    kv_indices: torch.Tensor  # [pages] int32: every request's used blocks, in order
    last_page_len: torch.Tensor  # [B] int32: tokens in each request's last page (1 .. block_size)
    sliding_window: int | None = None
    step: int = 0  # which step this is (a wrapper's plan is for one step's metadata)


def paged_kv_pages(
    block_table: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's paged layout of a step: (kv_indptr [B + 1], kv_indices [pages], last_page_len [B]) from
    the block table [B, blocks] and the cached + new lengths [B]."""
    pages = -(-seq_lens // block_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(block_table.shape[1])[None, :] < pages[:, None]
    return indptr, block_table[used], seq_lens - (pages - 1) * block_size


class _LibraryBackend(TritonPagedBackend):
    """What both share: the cache write of the Triton backend, the refusals."""

    package: str
    supported_features = ("sliding_window", "logits_soft_cap")

    def __init__(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16) or is_quantized(cache_dtype) or cache_dtype != dtype:
            raise ValueError(
                f"attention backend {self.name} runs float16 / bfloat16 compute over a cache of the same dtype; "
                f"got {dtype} over {cache_dtype} (use --dtype bfloat16 --kv-cache-dtype auto, or another backend)"
            )

    def check_layer(self, layer) -> None:
        super().check_layer(layer)
        if layer.latent_rope_dim is not None:
            raise ValueError(f"attention backend {self.name} does not read MLA latent caches ({layer.layer_name})")


class FlashAttnBackend(_LibraryBackend):
    name = "flash-attn"

    def kv_cache_shape(self, num_blocks, block_size, spec):
        if block_size % 256:
            raise ValueError(
                f"attention backend flash-attn pages blocks of a multiple of 256 tokens; --block-size is {block_size}"
            )
        return super().kv_cache_shape(num_blocks, block_size, spec)

    def build_metadata(self, common, sliding_window=None) -> FlashAttnMetadata:
        return flash_attn_metadata(common, sliding_window)

    def _attend(self, q, k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks):
        from flash_attn import flash_attn_varlen_func

        w = meta.sliding_window
        return flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, window_size=(-1, -1) if w is None else (w - 1, 0),
            softcap=soft_cap or 0.0, block_table=meta.block_table,
        )  # fmt: skip


class FlashInferBackend(_LibraryBackend):
    name = "flashinfer"

    def __init__(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        super().__init__(dtype, cache_dtype)
        self.wrappers: dict[int | None, tuple[object, tuple]] = {}  # per window: (wrapper, what it was planned for)
        self.steps = itertools.count(1)

    def build_metadata(self, common, sliding_window=None) -> FlashInferMetadata:
        indptr, indices, last = paged_kv_pages(common.block_table, common.seq_lens, common.block_size)
        host = [torch.from_numpy(a.astype(np.int32)) for a in (common.query_start_loc, indptr, indices, last)]
        return FlashInferMetadata(common.slot_mapping, *host, sliding_window, next(self.steps))

    def _attend(self, q, k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks):
        import flashinfer

        w = meta.sliding_window
        wrapper, planned = self.wrappers.get(w, (None, None))
        if wrapper is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        key = (meta.step, q.shape[1], scale, soft_cap)
        if planned != key:  # the first layer of this step (or one with other heads, scale or cap)
            wrapper.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len,
                q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], causal=True, sm_scale=scale,
                window_left=-1 if w is None else w - 1, logits_soft_cap=soft_cap, q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )  # fmt: skip
        self.wrappers[w] = (wrapper, key)
        return wrapper.run(q, (k_cache, v_cache))
