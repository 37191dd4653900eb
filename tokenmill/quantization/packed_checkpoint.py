"""Checkpoints that store each linear layer as several tensors (AWQ's qweight/qzeros/scales,
compressed-tensors' weight_packed/weight_scale/...), unpacked on load into the block layout of the
integer kernels (`gguf.BlockLayout`) without a dense float weight.

A `PackedFormat` says which tensors a layer has and turns one shard's tensors into `Codes` (the
columns in checkpoint order) plus, for act-order checkpoints, each column's group. The method keeps
every part of every shard until all are in, then packs them. Act-order: the columns are sorted by
group on load, and each step's activations are permuted the same way before the matmul (shards of
one fused layer share their input, so they must share the order; a checkpoint where they differ is
refused). Without act-order a tensor-parallel rank takes its columns in whole blocks of the layout
(32, or 16 for NVFP4), whatever the group size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import numpy as np
import torch

from tokenmill.quantization.gguf import BlockLayout, BlockQuantLinearMethod
from tokenmill.quantization.gguf_codes import Codes

_ALL = slice(None)


class PackedFormat(ABC):
    """One checkpoint layout: `name` (for errors), `layout` and `half` (the blocks it packs into: half
    False keeps float32 scales), `kinds` / `optional_kinds` (the tensors of a shard, "weight" included
    when the checkpoint calls one of them that), `g_idx_kind` (the act-order tensor, if any) and
    `group_size` (columns per scale; None: the whole row)."""

    name: str
    layout: BlockLayout
    half: bool
    kinds: tuple[str, ...]
    optional_kinds: tuple[str, ...] = ()
    g_idx_kind: str | None = None
    group_size: int | None = None

    @abstractmethod
    def codes(self, parts: dict[str, torch.Tensor]) -> Codes:
        """One shard's tensors (every kind it holds) as `Codes` [rows, columns] in checkpoint order."""


class PackedCheckpointMethod(BlockQuantLinearMethod):
    def __init__(self, fmt: PackedFormat, int8_activations: bool) -> None:
        super().__init__(fmt.layout, int8_activations, half=fmt.half and int8_activations)
        self.fmt = fmt
        self.checkpoint_kinds = fmt.kinds
        self.optional_kinds = fmt.optional_kinds

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        group = self.fmt.group_size or layer.input_size
        if group % self.layout.block or layer.input_size % group:
            raise ValueError(
                f"{layer.prefix}: group size {group} does not split its {layer.input_size} input columns "
                f"into whole blocks of {self.layout.block}"
            )
        super().create_weights(layer, input_size, output_sizes, params_dtype)
        layer.register_buffer("input_perm", None)
        layer.pending_parts = {}

    def load(self, layer, weight, rows, src_rows, src_cols):
        if "weight" not in self.checkpoint_kinds:
            raise ValueError(
                f"is a dense weight, but {self.fmt.name} layers are stored as {'/'.join(self.checkpoint_kinds)}"
            )
        self.load_part(layer, "weight", weight, rows, src_rows, src_cols)

    def load_part(self, layer, kind, weight, rows, src_rows, src_cols):
        layer.pending_parts.setdefault((rows.start, rows.stop), {})[kind] = (weight, src_rows, src_cols)

    def process_after_loading(self, layer):
        order = None
        for (start, stop), parts in layer.pending_parts.items():
            _, src_rows, src_cols = parts[self.checkpoint_kinds[0]]
            codes = self.fmt.codes({k: v[0] for k, v in parts.items()})
            if self.fmt.g_idx_kind in parts:
                g_idx = parts[self.fmt.g_idx_kind][0].numpy().astype(np.int64)
                perm = np.argsort(g_idx, kind="stable")
                if order is not None and not np.array_equal(order, perm):
                    raise ValueError(
                        f"{layer.prefix}: its fused shards order their input columns differently "
                        f"({self.fmt.g_idx_kind}), which one matmul cannot follow"
                    )
                order = perm
                group = codes.q.shape[1] // codes.scales.shape[1]
                if not np.array_equal(g_idx[perm], np.arange(codes.q.shape[1]) // group):
                    raise ValueError(f"{layer.prefix}: {self.fmt.g_idx_kind} does not give every group {group} columns")
                codes = replace(codes, q=codes.q[:, perm])
            if src_cols != _ALL:
                if order is not None and not np.array_equal(order, np.arange(order.size)):
                    raise ValueError(
                        f"{layer.prefix}: act-order {self.fmt.name} layers cannot be split by columns "
                        "(tensor parallelism)"
                    )
                codes = _per_block(codes, self.layout.block).columns(src_cols)
            self.write(layer, codes, slice(start, stop), src_rows, round_half=True)
        del layer.pending_parts
        if order is not None and not np.array_equal(order, np.arange(order.size)):
            layer.input_perm = torch.from_numpy(order).to(layer.codes.device)
        super().process_after_loading(layer)

    def apply(self, layer, x, bias):
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        return super().apply(layer, x, bias)

    def decode_operands(self, layer):
        return None if layer.input_perm is not None else super().decode_operands(layer)


def _per_block(codes: Codes, block: int) -> Codes:
    """The same weights with their scales and offsets repeated per `block` columns (so that a split
    between groups of a larger group size, or of a per-channel scale, falls on whole blocks)."""
    if codes.block <= block or codes.block % block:
        return codes
    repeat = codes.block // block
    return replace(
        codes,
        scales=np.repeat(codes.scales, repeat, axis=1),
        block=block,
        offsets=None if codes.offsets is None else np.repeat(codes.offsets, repeat, axis=1),
    )
