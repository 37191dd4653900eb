"""Gated activations on a fused [gate | up] projection (plain functions: no module call per layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels import fused_ops, triton_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> silu(gate) * up, [..., I] (one C++ call on CPU float32, one Triton kernel on CUDA)."""
    if fused_ops.applies(gate_up) and gate_up.dim() == 2:
        return fused_ops.silu_and_mul(gate_up)
    if triton_fused.applies(gate_up):
        return triton_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> gelu_tanh(gate) * up, [..., I] (GeGLU with the tanh approximation, as Gemma; one
    C++ call on CPU float32, one Triton kernel on CUDA)."""
    if fused_ops.applies(gate_up) and gate_up.dim() == 2:
        return fused_ops.gelu_tanh_and_mul(gate_up)
    if triton_fused.applies(gate_up):
        return triton_fused.gelu_and_mul(gate_up, "tanh")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2 I] -> GPT-OSS's gated activation, [..., I]: gate clamped above at `limit`, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1). Bind alpha and limit with
    functools.partial."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)
