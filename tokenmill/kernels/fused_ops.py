"""Fused elementwise kernels for CPU float32: add + RMSNorm, rotary embedding in place, SiLU * mul and
GELU-tanh * mul, and each row's argmax (the greedy sampler's step over the vocabulary).

At decode time a layer's elementwise work is a few thousand floats; as separate torch ops each
costs more in dispatch and temporaries than in arithmetic (RMSNorm alone is six ops). One C++ call
each instead (csrc/fused_ops.cpp). The math is the same as the torch path in `tokenmill.layers` (float32).
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels


def load():
    """The compiled extension (`tokenmill.kernels.cpu_kernels`), or None when there is none here."""
    return cpu_kernels()


def applies(x: torch.Tensor) -> bool:
    """Whether the fused kernels handle this tensor (CPU float32, kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); x is updated in place to the sum."""
    out = torch.empty_like(x)
    load().add_rms_norm(x, residual, weight, eps, out)
    return out, x


def rotary_inplace(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    load().rotary_inplace(x, positions, cos_sin)
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load().silu_and_mul(gate_up, out)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up as gate / (1 + e^(-2u)) * up (0.5 (1 + tanh(u)) is the logistic of 2u)."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load().gelu_tanh_and_mul(gate_up, out)
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[B, V] contiguous -> [B] long: each row's first index of its largest value (a NaN counts as largest)."""
    out = x.new_empty(x.shape[0], dtype=torch.long)  # made from x, as the other kernels' outputs are
    load().row_argmax(x, out)
    return out
