"""Dense weights in the compute dtype: `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.base import LinearMethod, QuantizationConfig, stored


def load_dense(param: torch.Tensor, weight, rows: slice, src_index: tuple[slice, ...]) -> None:
    """Put `weight[src_index]` (dequantized if packed) in `param[rows]`, checking the shape. A source
    the parameter can use as is becomes the parameter instead of being copied (`usable_as_is`): for
    safetensors and GGUF float tensors that is a view of the file's private map, so those weights are
    read from the page cache and never held twice."""
    src = stored(weight)[src_index]
    dest = param.data[rows]
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    if dest.shape == param.shape and usable_as_is(src, param):
        param.data = src
    else:
        dest.copy_(src)


def usable_as_is(src: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether `src` can replace all of `param`'s storage: same dtype, on the CPU, contiguous, and
    the whole of its own storage (a slice of a bigger tensor would keep all of it alive)."""
    return (
        src.dtype == param.dtype
        and src.device.type == param.device.type == "cpu"
        and not src.requires_grad
        and src.is_contiguous()
        and src.storage_offset() == 0
        and src.untyped_storage().nbytes() == src.nbytes
    )


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
