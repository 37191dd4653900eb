"""Weight-only INT8 quantization for CPU decoding (opt-in: `--quantization int8`).

Every linear layer's weight becomes int8 with one float scale per output row (symmetric, absmax);
the matmul is torch's packed `_weight_int8pack_mm`, which reads a quarter of the float32 bytes and
runs on bfloat16 activations. Decoding on CPU is memory-bound, so this is ~3x less time per
weight; the price is that outputs are no longer bit-identical to the float32 reference.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8",)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str, device: torch.device) -> None:
    """Replace the model's linear layers (projections, MLP and the output head) in place."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} uses a CPU kernel; it is not available on {device.type}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
