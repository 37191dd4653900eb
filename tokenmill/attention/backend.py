"""Paged attention: the interface every backend implements, and the plain-PyTorch backend.

A step's flat batch holds the new tokens of many sequences back to back. For each sequence the
metadata says how many of its tokens are already in the KV cache (`num_cached`), how many are new
(`num_new`) and which cache blocks hold it (`block_table`). New K/V are written at `slot_mapping`
(block * block_size + offset); attention then covers cached + new tokens under the causal mask.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.kernels import paged_attention


@dataclass
class SequenceSlice:
    """One sequence's part of a step, as the model runner describes it to the backend."""

    num_cached: int
    num_new: int
    block_table: list[int]


@dataclass
class PrefillMetadata:
    """A sequence with several new tokens (a prompt chunk), attended one sequence at a time."""

    start: int  # offset of its first new token in the flat batch
    end: int
    num_cached: int
    block_table: torch.Tensor | None  # None when nothing is cached: attend the new K/V directly
    mask: torch.Tensor | None  # [num_new, num_cached + num_new] bool, None when nothing is cached


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once per step and shared by all layers.
    Single-token (decode) sequences come first in the flat batch and are attended as one batch."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] long, cached + the new token
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool (gather path)
    prefills: list[PrefillMetadata]


class AttentionBackend(ABC):
    """Interface: build the step metadata once, then run attention for each layer."""

    name: str

    @abstractmethod
    def build_metadata(self, seqs: list[SequenceSlice], block_size: int, device: torch.device) -> AttentionMetadata:
        """Describe one step's flat batch (decode sequences first) for all layers."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write the new K/V into `kv_cache`, attend. q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D]."""


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops (SDPA) only: runs on CPU and CUDA. Decode gathers each
    sequence's blocks into a padded batch and runs one masked SDPA."""

    name = "torch-sdpa"
    needs_decode_mask = True

    def build_metadata(self, seqs: list[SequenceSlice], block_size: int, device: torch.device) -> AttentionMetadata:
        num_new = np.fromiter((s.num_new for s in seqs), dtype=np.int64, count=len(seqs))
        num_cached = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=len(seqs))
        num_decodes = int(np.argmax(num_new != 1)) if (num_new != 1).any() else len(seqs)
        if (num_new[num_decodes:] == 1).any():
            raise ValueError("attention metadata: single-token sequences must come first in the batch")

        # slot of every new token: block_table[pos // bs] * bs + pos % bs, vectorised over the step
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        seq_of_token = np.repeat(np.arange(len(seqs)), num_new)
        starts = np.cumsum(num_new) - num_new
        pos = np.arange(int(num_new.sum())) - starts[seq_of_token] + num_cached[seq_of_token]
        slots = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
        slot_mapping = torch.from_numpy(slots).to(device)

        decode_tables = decode_lens = decode_mask = None
        if num_decodes:
            ctx = num_cached[:num_decodes] + 1
            nb = int((ctx.max() + block_size - 1) // block_size)
            decode_tables = torch.from_numpy(np.ascontiguousarray(tables[:num_decodes, :nb])).to(device)
            decode_lens = torch.from_numpy(ctx).to(device)
            if self.needs_decode_mask:
                mask = np.arange(nb * block_size)[None, :] < ctx[:, None]
                decode_mask = torch.from_numpy(mask).to(device)[:, None, None, :]

        prefills = []
        for i in range(num_decodes, len(seqs)):
            start, n, c = int(starts[i]), int(num_new[i]), int(num_cached[i])
            table = mask = None
            if c:
                nb = (c + n + block_size - 1) // block_size
                table = torch.from_numpy(tables[i, :nb].copy()).to(device)
                keys = torch.arange(c + n, device=device)
                mask = keys[None, :] <= (c + torch.arange(n, device=device))[:, None]
            prefills.append(PrefillMetadata(start, start + n, c, table, mask))
        return AttentionMetadata(slot_mapping, num_decodes, decode_tables, decode_lens, decode_mask, prefills)

    def forward(self, q, k, v, kv_cache, meta, scale):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        d = meta.num_decodes
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale)
        for p in meta.prefills:
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if p.block_table is None:
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                length = p.mask.shape[1]
                ks = _gather(k_cache, p.block_table[None])[:, :, :length]
                vs = _gather(v_cache, p.block_table[None])[:, :, :length]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out


    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def _decode(self, q, k_cache, v_cache, meta, scale):
        keys = _gather(k_cache, meta.decode_block_tables)  # [D, KVH, L, hd]
        values = _gather(v_cache, meta.decode_block_tables)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)


class CpuAttentionBackend(TorchAttentionBackend):
    """CPU float32: decode reads K/V straight from the blocks with a compiled kernel (no gather
    copy, no padding); prompt chunks use the torch path."""

    name = "cpu-paged"
    needs_decode_mask = False

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if k.stride(-1) == 1 and v.stride(-1) == 1:
            paged_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta, scale):
        return paged_attention.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_context_lens, scale)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, KVH, hd] cache + [B, nb] tables -> [B, KVH, nb * bs, hd]."""
    b, nb = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))  # whole blocks: row copies, not per element
    return blocks.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def get_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend for a device and KV dtype: the compiled paged kernel on CPU float32 when it
    builds, else plain torch ops (GPU kernels plug in here)."""
    if device.type == "cpu" and dtype == torch.float32 and paged_attention.load() is not None:
        return CpuAttentionBackend()
    return TorchAttentionBackend()
