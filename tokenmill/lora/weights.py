"""`LoRAWeights`: the adapters' factors of one linear layer, every slot stacked, and the delta they add
to the layer's output for the step's tokens.

A fused layer (qkv_proj, gate_up_proj) holds a separate adapter module per shard, so its A factors
are stacked by shard ([slots, shards * rank, in]) and B is block-diagonal ([slots, out, shards *
rank]: shard i's rows read only columns i * rank ...): one pair of matmuls per adapter covers every
shard. Rows and columns an adapter does not use stay zero, which adds exactly nothing. The delta is
added to whatever the base layer's weight format computed, so it composes with every quantization
method."""

from __future__ import annotations

import torch

from tokenmill.layers.forward_context import current_lora_batch


class LoRAWeights:
    def __init__(
        self, in_features: int, out_sizes: list[int], slots: int, rank: int, dtype: torch.dtype, device
    ) -> None:
        self.rank, self.out_sizes = rank, list(out_sizes)
        shards = len(out_sizes)
        self.a = torch.zeros(slots, shards * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, sum(out_sizes), shards * rank, dtype=dtype, device=device)
        self.scaling = [0.0] * slots

    def set(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Shard `shard`'s factors in `slot` (a: [r, in], b: [shard rows, r]; r <= rank, zero-padded)."""
        if a.shape[1] != self.a.shape[2] or b.shape[0] != self.out_sizes[shard]:
            raise ValueError(
                f"factors of shape {list(a.shape)} / {list(b.shape)} do not fit a layer of "
                f"{self.a.shape[2]} inputs and {self.out_sizes[shard]} outputs"
            )
        cols, rows = shard * self.rank, sum(self.out_sizes[:shard])
        r = a.shape[0]
        self.a[slot, cols : cols + r] = a
        self.b[slot, rows : rows + b.shape[0], cols : cols + r] = b

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scaling[slot] = 0.0

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus each token's adapter's delta, per group of
        tokens sharing an adapter: (x A^T) B^T * scaling, as PEFT computes it."""
        batch = current_lora_batch()
        if batch is None:
            return out
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = ((xs @ self.a[slot].T) @ self.b[slot].T * self.scaling[slot]).to(out.dtype)
            if rows is None:
                out = out + delta
            else:
                out = out.index_add(0, rows, delta)
        return out
