"""LoRA adapters' low-rank products for a whole batch in one C++ call, on CPU float32.

A step mixing adapters adds to each linear layer's output, per group of tokens running one adapter,
(x A^T) B * scaling. As torch ops that is an index_select, two small matmuls, a multiply and an
index_add per adapter and layer: on a small model the calls cost more than the arithmetic. Here
(csrc/lora.cpp, as vLLM's punica kernels split it: shrink, then expand) one call covers every
segment of the batch: the rows are given as segments of consecutive rows running one adapter slot
(-1: the base model, whose rows are left untouched), each with its adapter's scaling.

Layout (`tokenmill.lora.weights.LoRAWeights`): a [slots, R, K] holds each slot's shrink factors, every
shard's stacked (R = shards * rank); b [slots, R, N] the expand factors with the rank rows first, so
the expand runs along the contiguous output columns; shard_offsets [shards + 1] where each shard's
output columns start: rank rows of shard j feed only its columns, the rest of the row is zero and
skipped. Accumulation is in float32, in another order than torch's GEMM (results agree to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import cpu_kernels


@dataclass
class Segments:
    """The batch's rows as runs running one adapter slot: rows starts[g] .. starts[g + 1] run slot
    slots[g] (-1: the base model) scaled by scales[g] (int64 [G + 1], int64 [G], float32 [G], CPU)."""

    starts: torch.Tensor
    slots: torch.Tensor
    scales: torch.Tensor


def applies(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the kernel handles this layer's inputs and factors (CPU float32, kernels built)."""
    return x.device.type == "cpu" and x.dtype == a.dtype == torch.float32 and cpu_kernels() is not None


def add(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    shard_offsets: torch.Tensor,
    segments: Segments,
    out: torch.Tensor,
) -> torch.Tensor:
    """`out` [T, N] plus each segment's (x A^T) B * scaling, in place; returned."""
    out = out.contiguous()
    cpu_kernels().lora_add(x.contiguous(), a, b, shard_offsets, segments.starts, segments.slots, segments.scales, out)
    return out
