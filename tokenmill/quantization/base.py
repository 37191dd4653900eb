"""The interface every weight format implements.

A `QuantizationConfig` (built once per model, from the checkpoint and the `--quantization` flag)
gives each linear layer its `LinearMethod` when the layer is built. The method owns the layer's
weight storage from then on:

    create_weights(layer, ...)      register the parameters/buffers the format stores
    load(layer, weight, ...)        copy one checkpoint tensor (or one shard of a fused layer) in
    load_part(layer, kind, ...)     the same for a format stored as several tensors per layer
                                    (`checkpoint_kinds`, e.g. AWQ's qweight, qzeros, scales)
    process_after_loading(layer)    repack once every tensor is in (e.g. quantize on load)
    apply(layer, x, bias)           the matmul
    decode_operands(layer)          the same matmul as the compiled decode step calls it (optional)

The layer itself keeps what every format shares: sizes, the bias, and how checkpoint shards and
tensor-parallel ranks map onto its rows and columns (`tokenmill.layers.linear`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    # the checkpoint tensors of a layer (per fused shard) besides its bias: all must arrive, and the
    # optional ones may (e.g. GPTQ's g_idx, which act-order checkpoints need and others carry anyway)
    checkpoint_kinds: tuple[str, ...] = ("weight",)
    optional_kinds: tuple[str, ...] = ()

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the weight storage of a layer with `input_size` columns and `sum(output_sizes)`
        rows (one entry per fused shard), on the current default device."""

    @abstractmethod
    def load(self, layer: nn.Module, weight, rows: slice, src_rows: slice, src_cols: slice) -> None:
        """Copy rows `src_rows`, columns `src_cols` of checkpoint tensor `weight` (a tensor, or the
        loader's packed form of it) into the layer's rows `rows`."""

    def load_part(
        self, layer: nn.Module, kind: str, weight: torch.Tensor, rows: slice, src_rows: slice, src_cols: slice
    ) -> None:
        """Take checkpoint tensor `kind` (one of `checkpoint_kinds` other than "weight", or of
        `optional_kinds`) for the layer's rows `rows`; formats that need every part of a shard
        before they can pack it keep them until `process_after_loading`."""
        raise ValueError(f"is a {kind!r} tensor, which this weight format does not read")

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor of the model was loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size]."""

    def decode_operands(self, layer: nn.Module) -> tuple[int, int, int, list[torch.Tensor | None], int | None] | None:
        """How the compiled decode step (`tokenmill.kernels.decode_step`) runs this layer's `apply`:
        (kind, bits, center, [weight or codes, high, scales, offsets, supers, panel codes, panel
        scales], most tokens per call or None), or None when it cannot (the model's own forward runs
        then)."""
        return None


class QuantizationConfig(ABC):
    """Chooses a `LinearMethod` per layer. `packed_modules` (set from the model class before the
    model is built) says which checkpoint modules each fused layer holds, e.g.
    {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}."""

    name: str

    def __init__(self) -> None:
        self.packed_modules: dict[str, list[str]] = {}

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer named `prefix` (HF naming, e.g.
        `model.layers.0.self_attn.qkv_proj`, or `lm_head`)."""

    def expert_method(self, prefix: str) -> LinearMethod | None:
        """The format of the routed experts of the MoE layer `prefix` (e.g. `model.layers.0.mlp.experts`),
        each projection of each expert held like a linear layer of it; None: dense experts."""
        return None

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint weight names of the layer `prefix`, one per fused shard."""
        parent, _, module = prefix.rpartition(".")
        parts = self.packed_modules.get(module, [module])
        return [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in parts]


def dense(weight) -> torch.Tensor:
    """A checkpoint tensor as a dense float tensor (GGUF tensors are dequantized here)."""
    return weight.dequantize() if hasattr(weight, "dequantize") else weight


def stored(weight) -> torch.Tensor:
    """A checkpoint tensor as a dense tensor in the float dtype it is stored in (a GGUF F16 tensor
    stays float16, as a view of the file's map), for a copy that converts it only where it must."""
    return weight.stored() if hasattr(weight, "stored") else dense(weight)
