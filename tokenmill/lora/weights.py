"""`LoRAWeights`: the adapters' factors of one linear layer, every slot stacked, and the delta they add
to the layer's output for the step's tokens.

A fused layer (qkv_proj, gate_up_proj) holds a separate adapter module per shard, so its A factors
are stacked by shard ([slots, shards * rank, in]) and B is block-diagonal, stored rank rows first
([slots, shards * rank, out]: rank row i * rank ... of shard i feeds only shard i's columns): one pair
of matmuls per adapter covers every shard. Rows and columns an adapter does not use stay zero, which
adds exactly nothing. The delta is added to whatever the base layer's weight format computed, so it
composes with every quantization method. On CPU float32 one C++ call adds every segment's delta
(`tokenmill.kernels.lora`); elsewhere torch ops per group of tokens sharing an adapter."""

from __future__ import annotations

import itertools

import torch

from tokenmill.kernels import lora as lora_kernel
from tokenmill.layers.forward_context import current_lora_batch


class LoRAWeights:
    def __init__(
        self, in_features: int, out_sizes: list[int], slots: int, rank: int, dtype: torch.dtype, device
    ) -> None:
        self.rank, self.out_sizes = rank, list(out_sizes)
        shards = len(out_sizes)
        self.a = torch.zeros(slots, shards * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, shards * rank, sum(out_sizes), dtype=dtype, device=device)
        self.shard_offsets = torch.tensor([0, *itertools.accumulate(out_sizes)], dtype=torch.int64)

    def set(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Shard `shard`'s factors in `slot` (a: [r, in], b: [shard rows, r]; r <= rank, zero-padded)."""
        if a.shape[1] != self.a.shape[2] or b.shape[0] != self.out_sizes[shard]:
            raise ValueError(
                f"factors of shape {list(a.shape)} / {list(b.shape)} do not fit a layer of "
                f"{self.a.shape[2]} inputs and {self.out_sizes[shard]} outputs"
            )
        ranks, cols = shard * self.rank, sum(self.out_sizes[:shard])
        r = a.shape[0]
        self.a[slot, ranks : ranks + r] = a
        self.b[slot, ranks : ranks + r, cols : cols + b.shape[0]] = b.T

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus each token's adapter's delta, per group of
        tokens sharing an adapter: (x A^T) B^T * scaling, as PEFT computes it."""
        batch = current_lora_batch()
        if batch is None:
            return out
        if lora_kernel.applies(x, self.a):
            return lora_kernel.add(x, self.a, self.b, self.shard_offsets, batch.segments, out)
        for slot, rows, scaling in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = ((xs @ self.a[slot].T) @ self.b[slot] * scaling).to(out.dtype)
            if rows is None:
                out = out + delta
            else:
                out = out.index_add(0, rows, delta)
        return out
