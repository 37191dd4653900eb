"""`int8` (opt-in, CPU): weights quantized on load to int8 with one scale per output row
(symmetric, absmax); the matmul is torch's packed `_weight_int8pack_mm` on bfloat16 activations.
Outputs are close to, not bit-identical with, the float32 reference."""

from __future__ import annotations

import torch

from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedLinearMethod


class Int8LinearMethod(LinearMethod):
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, params_dtype)

    def load(self, layer, weight, rows, src_rows, src_cols):
        UnquantizedLinearMethod().load(layer, weight, rows, src_rows, src_cols)

    def process_after_loading(self, layer):
        weight = layer.weight.detach().float()
        del layer.weight
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        layer.register_buffer("qweight", torch.round(weight / scales[:, None]).to(torch.int8))
        layer.register_buffer("scales", scales.to(torch.bfloat16))

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, layer.qweight, layer.scales).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])


class Int8Config(QuantizationConfig):
    name = "int8"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        if device.type != "cpu":
            raise ValueError(f"quantization 'int8' uses a CPU kernel; it is not available on {device.type}")

    def linear_method(self, prefix: str) -> LinearMethod:
        return Int8LinearMethod()
