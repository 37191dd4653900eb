"""Context parallelism's attention (`--decode-context-parallel-size` / `--prefill-context-parallel-size`
N): each sequence's KV cache striped over the N ranks of `parallel_state`'s context-parallel group.

Layout: token-interleaved. The token at position p lives on rank p % N, in the same block id the
scheduler gave it, at offset (p % block_size) // N of that rank's block of block_size / N slots. The
block manager, the prefix cache and the block tables are the one-process ones (a block still holds
block_size tokens, just spread over the ranks); each rank allocates block_size / N slots per block, so
its KV bytes per sequence are 1/N of one process's. Interleaving by token rather than by block keeps
every sequence — a short one, the growing last block of a decode — spread evenly, and gives each
rank an even share of a prompt's causal work without a zigzag order.

Attention: every rank holds every query of the step, attends over its own stripe of each request's
keys (its part of the causal prefix: cached tokens and the step's new ones alike), and the partial
outputs with their log-sum-exp are all-gathered (one `cp_all_gather` per layer) and merged the same
way on every rank: out = sum_r exp(lse_r - lse) out_r with lse = log sum_r exp(lse_r) (sinks join
that sum with no value). Every rank gets the same bits, so every rank samples the same tokens.

Decode context parallelism: every rank runs the whole step (the same tokens through the same weights)
and stores only its stripe of the new K/V. With tensor parallelism the N ranks are the tensor-parallel
ones (vLLM's sharing): each computes its heads' q/k/v, gathers every head's (an MLA latent row is
the same on every rank: it is not gathered), stores every kv head for its stripe of the tokens and
attends every head over it; one all-to-all then hands each rank every rank's partials of its own
heads, which it merges. An MLA cache then holds 1/N of
the latent rows per rank where tensor parallelism alone keeps all of them on every rank. Prefill context parallelism: a step with a prompt chunk
is split by the same ownership — each rank runs only the tokens it stores (`TokenSplit`), so it
computes exactly the K/V it keeps and no K/V ever moves; the queries are all-gathered instead (fewer
bytes than the cached prefix's K/V, which is spread over the ranks anyway), and the step's final
hidden states are all-gathered after the last layer. A step of decodes only is not split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.kv_spec import AttentionSpec
from tokenmill.attention.metadata import CommonAttentionMetadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend, _gather_kv
from tokenmill.distributed import parallel_state


@dataclass
class TokenSplit:
    """Prefill context parallelism: the flat batch's rows each rank computes (those it stores)."""

    rows: list[torch.Tensor]  # per rank, its rows in batch order (long, on the device)
    total: int  # rows of the whole batch

    @property
    def mine(self) -> torch.Tensor:
        return self.rows[parallel_state.cp_rank()]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [rows, ...] tensor -> every rank's, in batch order (one all-gather,
        padded to the largest share)."""
        width = max(len(r) for r in self.rows)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: len(x)] = x
        parts = parallel_state.cp_all_gather(padded)
        out = x.new_empty(self.total, *x.shape[1:])
        for rank, rows in enumerate(self.rows):
            out[rows] = parts[rank, : len(rows)]
        return out


@dataclass
class RequestKeys:
    """One request's queries (rows of the whole batch) and this rank's stripe of its keys."""

    start: int
    end: int
    block_table: torch.Tensor  # [blocks] the request's blocks up to its last new token
    mask: torch.Tensor  # [queries, blocks * local block size] bool: which local keys each query sees


@dataclass
class ContextParallelMetadata:
    write_rows: torch.Tensor | None  # rows of the computed tokens whose K/V this rank stores (None: all)
    slot_mapping: torch.Tensor  # their slots in this rank's cache
    requests: list[RequestKeys]
    split: TokenSplit | None  # prefill context parallelism: the step's rows per rank (None: not split)


def token_positions(common: CommonAttentionMetadata) -> np.ndarray:
    """The position of each row of the step's flat batch."""
    new = np.diff(common.query_start_loc)
    req = np.repeat(np.arange(common.num_reqs), new)
    return np.arange(len(req)) - common.query_start_loc[req] + common.num_computed_tokens[req]


def token_split(common: CommonAttentionMetadata, size: int) -> TokenSplit | None:
    """Rows per rank (position % size) when the step has a prompt chunk and every rank gets a row;
    None otherwise (every rank runs every row)."""
    positions = token_positions(common)
    if common.num_decodes == common.num_reqs:
        return None
    rows = [np.flatnonzero(positions % size == r) for r in range(size)]
    if min(len(r) for r in rows) == 0:
        return None
    return TokenSplit([torch.from_numpy(r).to(common.device) for r in rows], len(positions))


class ContextParallelBackend(TorchSDPABackend):
    """Attention over this rank's stripe of the KV cache, merged over the context-parallel group."""

    name = "context-parallel"
    supported_features = ("sliding_window", "logits_soft_cap", "sinks")

    def __init__(self, split_prefill: bool) -> None:
        self.rank, self.size = parallel_state.cp_rank(), parallel_state.cp_size()
        self.split_prefill = split_prefill
        self.share_heads = parallel_state.tp_size() > 1  # the ranks are also tensor-parallel ranks

    def kv_cache_shape(self, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        return super().kv_cache_shape(num_blocks, block_size // self.size, spec)

    def token_split(self, common: CommonAttentionMetadata) -> TokenSplit | None:
        """Which rows this step's ranks compute (prefill context parallelism), or None: all of them."""
        return token_split(common, self.size) if self.split_prefill else None

    def build_metadata(self, common: CommonAttentionMetadata, sliding_window: int | None = None):
        n, bs, device = self.size, common.block_size, common.device
        local = bs // n
        positions = token_positions(common)
        req = np.repeat(np.arange(common.num_reqs), np.diff(common.query_start_loc))
        owned = np.flatnonzero(positions % n == self.rank)
        split = self.token_split(common)
        slots = common.block_table[req[owned], positions[owned] // bs] * local + positions[owned] % bs // n
        write_rows = None if split is not None else torch.from_numpy(owned).to(device)
        requests = []
        for i in range(common.num_reqs):
            start, end = int(common.query_start_loc[i]), int(common.query_start_loc[i + 1])
            blocks = -(-int(common.seq_lens[i]) // bs)
            first = 0 if sliding_window is None else max(0, int(positions[start]) - sliding_window + 1) // bs
            slot = np.arange(first * local, blocks * local)
            keys = slot // local * bs + slot % local * n + self.rank  # the position each local slot holds
            queries = positions[start:end, None]
            mask = keys[None, :] <= queries
            if sliding_window is not None:  # blocks before the window are not read (a window pool frees them)
                mask &= keys[None, :] > queries - sliding_window
            table = torch.from_numpy(np.ascontiguousarray(common.block_table[i, first:blocks])).to(device)
            requests.append(RequestKeys(start, end, table, torch.from_numpy(mask).to(device)))
        return ContextParallelMetadata(write_rows, torch.from_numpy(slots).to(device), requests, split)

    def forward(self, q, k, v, kv_cache, meta, scale, soft_cap=None, kv_scales=None, sinks=None):
        latent = kv_cache.shape[0] == 1
        heads = q.shape[1]  # this rank's
        if self.share_heads:  # every rank runs every token here (no token split with tensor parallelism)
            q = _all_heads(q)
            if not latent:
                k, v = _all_heads(k), _all_heads(v)
        if meta.write_rows is not None:
            k, v = k[meta.write_rows], v[meta.write_rows]
        k_cache, v_cache, kv_scales = self._store(k, v, kv_cache, meta.slot_mapping, kv_scales)
        if meta.split is not None:
            q = meta.split.gather(q)
        width = v.shape[-1]
        partial = q.new_empty(q.shape[0], q.shape[1], width + 1, dtype=torch.float32)  # out and lse per head
        for r in meta.requests:
            keys, values = _gather_kv(k_cache, v_cache, r.block_table[None], q.dtype, latent, kv_scales)
            partial[r.start : r.end] = _attend_stripe(q[r.start : r.end], keys[0], values[0], r.mask, scale, soft_cap)
        if self.share_heads:  # each rank's partials of rank r's heads go to rank r only
            by_owner = partial.view(partial.shape[0], self.size, heads, width + 1).transpose(0, 1)
            parts = parallel_state.cp_all_to_all(by_owner)
        else:
            parts = parallel_state.cp_all_gather(partial)
        out = _merge(parts, sinks).to(q.dtype)
        return out if meta.split is None else out[meta.split.mine]


def _all_heads(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] of this tensor-parallel rank -> [T, every rank's heads, D], in rank order."""
    t, heads, dim = x.shape
    return parallel_state.cp_all_gather(x).transpose(0, 1).reshape(t, parallel_state.cp_size() * heads, dim)


def _attend_stripe(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, soft_cap
) -> torch.Tensor:
    """Softmax attention of q [n, H, D] over one rank's keys / values [KVH, L, D] (float32): [n, H, Dv + 1],
    the output normalised over these keys and, last, their log-sum-exp (-inf, output 0: no key seen)."""
    group = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0).float(), values.repeat_interleave(group, 0).float()
    scores = q.transpose(0, 1).float() @ keys.transpose(-1, -2) * scale  # [H, n, L]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    out = (weights @ values) / total.clamp_min(torch.finfo(torch.float32).tiny)
    lse = peak + torch.log(total)
    return torch.cat((out, lse), dim=-1).transpose(0, 1)


def _merge(parts: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Every rank's partial outputs [ranks, T, H, Dv + 1] -> the attention output [T, H, Dv]: each
    weighted by its share exp(lse_r - lse) of the whole softmax (a sink: one more share, no value)."""
    outs, lse = parts[..., :-1], parts[..., -1]
    peak = lse.amax(0)
    if sinks is not None:
        peak = torch.maximum(peak, sinks.float())
    weights = torch.exp(lse - peak)  # [ranks, T, H]
    total = weights.sum(0)
    if sinks is not None:
        total = total + torch.exp(sinks.float() - peak)
    return (weights[..., None] * outs).sum(0) / total[..., None]
