"""Dense weights in the compute dtype: `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.base import LinearMethod, QuantizationConfig, dense


def load_dense(param: torch.Tensor, weight, rows: slice, src_index: tuple[slice, ...]) -> None:
    """Copy `weight[src_index]` (dequantized if packed) into `param[rows]`, checking the shape."""
    src = dense(weight)[src_index]
    dest = param.data[rows]
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)

    def load(self, layer, weight, rows, src_rows, src_cols):
        load_dense(layer.weight, weight, rows, (src_rows, src_cols))

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)

    def decode_operands(self, layer):
        w = layer.weight
        return (
            (0, 0, 0, [w, None, None, None, None, None, None], None)
            if w.dtype == torch.float32 and w.device.type == "cpu"
            else None
        )


class UnquantizedConfig(QuantizationConfig):
    name = "none"

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()
