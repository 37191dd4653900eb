"""Paged attention with torch ops (SDPA) only: runs on CPU and CUDA, any compute and cache dtype.

Decode requests (one new token each, first in the batch) gather their blocks into one padded batch
and run one masked SDPA; each prompt chunk runs SDPA on its own (directly on the new K/V when
nothing is cached, else over its gathered blocks under a causal mask offset by the cached length).
A sliding window narrows every mask to the last `window` positions; a logit soft-cap replaces SDPA
by the same computation written out (scores capped before the softmax). A latent cache (MLA: one
tensor, `kv_cache.shape[0] == 1`) stores only the keys; the values are their leading features.
An int8 / fp8 cache is quantized row by row as it is written and its gathered blocks are dequantized
with their scales (`kv_quant`); every op here runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention import kv_quant
from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import CommonAttentionMetadata


@dataclass
class PrefillMetadata:
    """A request with several new tokens (a prompt chunk), attended on its own."""

    start: int  # offset of its first new token in the flat batch
    end: int
    block_table: torch.Tensor | None  # None when nothing is cached: attend the new K/V directly
    mask: torch.Tensor | None  # [num_new, num_cached + num_new] bool; None: plain causal over the new K/V
    cached: int = 0  # tokens before the chunk in the cache (its first new token's position)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] long, cached + the new token
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, blocks * block_size] bool (gather path)
    prefills: list[PrefillMetadata]
    sliding_window: int | None = None


class TorchSDPABackend(AttentionBackend):
    name = "torch-sdpa"
    supported_features = ("sliding_window", "logits_soft_cap", "sinks")
    needs_decode_mask = True

    def build_metadata(
        self, common: CommonAttentionMetadata, sliding_window: int | None = None
    ) -> TorchAttentionMetadata:
        d, bs, device, w = common.num_decodes, common.block_size, common.device, sliding_window
        decode_tables = decode_lens = decode_mask = None
        if d:
            ctx = common.seq_lens[:d]
            nb = int((ctx.max() + bs - 1) // bs)
            decode_tables = torch.from_numpy(np.ascontiguousarray(common.block_table[:d, :nb])).to(device)
            decode_lens = torch.from_numpy(ctx).to(device)
            if self.needs_decode_mask:
                keys = np.arange(nb * bs)[None, :]
                mask = keys < ctx[:, None]
                if w is not None:
                    mask &= keys >= ctx[:, None] - w
                decode_mask = torch.from_numpy(mask).to(device)[:, None, None, :]
        prefills = []
        for i in range(d, common.num_reqs):
            start, end = int(common.query_start_loc[i]), int(common.query_start_loc[i + 1])
            c, n = int(common.num_computed_tokens[i]), end - start
            table = mask = None
            if c:
                table = torch.from_numpy(common.block_table[i, : (c + n + bs - 1) // bs].copy()).to(device)
            if c or (w is not None and n > w):
                keys, queries = (
                    torch.arange(c + n, device=device)[None, :],
                    (c + torch.arange(n, device=device))[:, None],
                )
                mask = keys <= queries
                if w is not None:
                    mask &= keys > queries - w
            prefills.append(PrefillMetadata(start, end, table, mask, c))
        return TorchAttentionMetadata(common.slot_mapping, d, decode_tables, decode_lens, decode_mask, prefills, w)

    def _store(self, k, v, kv_cache, slot_mapping, kv_scales):
        """Write the step's keys and values; returns the cache's key and value views and the scales to read
        them with (a latent cache, MLA: the values are the key rows' leading features, with the same scales)."""
        latent = kv_cache.shape[0] == 1
        k_cache = kv_cache[0]
        v_cache = k_cache[..., : v.shape[-1]] if latent else kv_cache[1]
        if latent and kv_scales is not None:
            kv_scales = kv_scales.expand(2, *kv_scales.shape[1:])
        self._write_kv(k, None if latent else v, k_cache, v_cache, slot_mapping, kv_scales)
        return k_cache, v_cache, kv_scales

    def forward(self, q, k, v, kv_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        k_cache, v_cache, kv_scales = self._store(k, v, kv_cache, meta.slot_mapping, kv_scales)
        d = meta.num_decodes
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale, soft_cap, kv_scales, sinks)
        for p in meta.prefills:
            out[p.start : p.end] = self._prefill(q, k, v, k_cache, v_cache, p, meta, scale, soft_cap, kv_scales, sinks)
        return out

    def _prefill(
        self, q, k, v, k_cache, v_cache, p: PrefillMetadata, meta, scale, soft_cap=None, kv_scales=None, sinks=None
    ):
        """One prompt chunk's (or verify step's) attention: [n, H, hd]. With nothing cached it attends
        the chunk's own K/V as computed (unquantized, as the float path does)."""
        latent = v_cache.data_ptr() == k_cache.data_ptr()
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if p.block_table is None:
            ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
        else:
            ks, vs = _gather_kv(k_cache, v_cache, p.block_table[None], q.dtype, latent, kv_scales)
            ks, vs = ks[:, :, : p.mask.shape[1]], vs[:, :, : p.mask.shape[1]]
        return _attend(qs, ks, vs, p.mask, scale, soft_cap, sinks)[0].transpose(0, 1)

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        """The step's keys and values into their slots (v None: a latent cache, keys only; quantized
        with their scales into `kv_scales` if given)."""
        if kv_scales is not None:
            kv_quant.write(k, k_cache, kv_scales[0], slot_mapping)
            if v is not None:
                kv_quant.write(v, v_cache, kv_scales[1], slot_mapping)
            return
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        if v is not None:
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def _decode(self, q, k_cache, v_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        latent = v_cache.data_ptr() == k_cache.data_ptr()
        # keys, values: [D, KVH, L, hd]
        keys, values = _gather_kv(k_cache, v_cache, meta.decode_block_tables, q.dtype, latent, kv_scales)
        return _attend(q.unsqueeze(2), keys, values, meta.decode_mask, scale, soft_cap, sinks).squeeze(2)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over [B, H, n, hd] queries and [B, KVH, L, hd] keys/values (heads
    grouped); `mask` (True = attend) or, when None, causal over n == L. Soft-capped scores, and
    sinks (each head's [H] logit in the softmax's denominator), are written out; otherwise SDPA."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    dtype: torch.dtype,
    latent: bool,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in `block_tables` (a latent cache is gathered once: values are
    the keys' leading features; a quantized one dequantized with `kv_scales`)."""
    k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
    keys = _gather(k_cache, block_tables, dtype, k_scales)
    return keys, keys[..., : v_cache.shape[-1]] if latent else _gather(v_cache, block_tables, dtype, v_scales)


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_blocks, bs, KVH, hd] cache + [B, nb] tables -> [B, KVH, nb * bs, hd] in `dtype` (a quantized
    cache times its [num_blocks, bs, KVH] scales)."""
    b, nb = block_tables.shape
    flat = block_tables.reshape(-1)
    if scales is None:
        blocks = cache.index_select(0, flat)  # whole blocks: row copies, not per element
    else:  # through bytes: fp8 index_select is not on every device
        blocks = kv_quant.dequantize(
            cache.view(torch.uint8).index_select(0, flat).view(cache.dtype), scales.index_select(0, flat), dtype
        )
    return blocks.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2).to(dtype)
