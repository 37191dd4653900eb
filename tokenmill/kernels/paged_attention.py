"""A C++ paged-attention kernel for decode on CPU (csrc/paged_attention.cpp; built as `tokenmill.kernels` says).

Decode attention reads each sequence's K/V straight from its cache blocks through the block table: no
gather copy, no padding to the longest sequence; float16 and bfloat16 caches are widened to float32 as
they are read (F16C; half the bytes of a float32 cache), int8 and fp8 (e4m3, e5m2) ones too, one byte
per value, their per-token scales (`tokenmill.attention.kv_quant`) folded into each token's score and
value weight: dequantized in registers, never copied. A task is one 128-token span of a sequence's
context for all the query heads of one kv head (GQA: the heads share each K/V read), OpenMP across
tasks, so one long sequence keeps every thread busy; each span leaves its softmax's partial max, sum and
weighted values, merged span by span in order. The spans depend on the sequence's own length only, so a
row's result does not depend on its batch nor on the thread count. A span's rows are asked into L2
ahead of their reads from inside the score loop (a step's 30 layers of K/V do not stay in cache; asking
as the slots are found cost as much as the walk when they were cached). With few spans per thread (short
contexts; a latent cache's single kv head) a span's query heads are split into several tasks. The scores
are computed a tile of 8 tokens at a time, each key row widened to float32 once for 3 query heads (one
with AVX2's 16 registers), their 8 x 3 sums in registers; the values are weighed for up to 8 heads per
pass, each row widened once per pass, the sums in registers; the softmax uses a vector exp (8 or 16
lanes: AVX2 or AVX-512) (every cached K/V byte is read once). A sliding window reads only the last `window` tokens; a soft-cap squashes
the scores (cap * tanh(s / cap)) before the softmax. Values may be narrower than keys and strided (a
latent MLA cache: the values are the leading features of the key rows). Without the kernels (none
prebuilt and no compiler, no OpenMP) `load()` returns None and the torch backend's gather + SDPA path is
used.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def load():
    """The compiled extension (`tokenmill.kernels.cpu_kernels`), or None when there is none here."""
    return cpu_kernels()


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's new keys and values at their cache slots, in one call for both."""
    load().write_kv(k, v, k_cache, v_cache, slot_mapping)


def write_kv_quantized(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same into an int8 / fp8 cache with its scales [2, blocks, block_size, KVH], bit for bit as
    `kv_quant.write`."""
    load().write_kv_quantized(k, v, k_cache, v_cache, kv_scales[0], kv_scales[1], slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, H, D] over each sequence's blocks; `kv_scales` [2, blocks, block_size, KVH]
    for an int8 / fp8 cache; `sinks` [H] float32 (each head's extra softmax logit)."""
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
    load().paged_decode_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        window or 0,
        soft_cap or 0.0,
        out,
        k_scales,
        v_scales,
        sinks,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's prompt chunk q [n, H, D] (its first query at position `start`, its
    keys and values already in the cache) over the sequence's blocks `block_table` [blocks] int64
    (csrc/prefill_attention.cpp: tiles of queries x tiles of keys, an online softmax, the cache read in
    place). A row's result does not depend on where the prompt was cut into chunks nor on the thread count.
    `new_kv`: the chunk's own keys and values [n, KVH, D] as computed, read instead of their cache rows.
    Arguments otherwise as `paged_decode_attention`'s."""
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
    k_new, v_new = (None, None) if new_kv is None else new_kv
    load().paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        start,
        scale,
        window or 0,
        soft_cap or 0.0,
        out,
        k_scales,
        v_scales,
        sinks,
        k_new,
        v_new,
    )
    return out
