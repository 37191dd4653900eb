"""Building blocks shared by decoder models: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig, rope_type
from tokenmill.kernels import fused_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does). With `residual`, adds it first and also returns the
    sum, so each decoder layer does one fused add+norm instead of two passes (on CPU float32 one
    kernel call, which leaves the sum in `x`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_ops.applies(x) and x.dim() == 2 and x.is_contiguous():
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x), x
        x = x + residual
        return self._norm(x), x


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with the checkpoint's rope scaling (default, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = rope_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout) with a precomputed cos/sin table indexed by token position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.cos_sin: torch.Tensor | None = None  # built on first use, on the model's device and dtype

    def _table(self, like: torch.Tensor) -> torch.Tensor:
        if self.cos_sin is None or self.cos_sin.device != like.device or self.cos_sin.dtype != like.dtype:
            with torch.device("cpu"):
                inv_freq = rope_inverse_frequencies(self.config)
                freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_sin = torch.stack((emb.cos(), emb.sin())).to(like.device, like.dtype)
        return self.cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, heads, D] (queries and keys stacked along heads) at `positions`: [T].
        On CPU float32 the rotation is done in place by a fused kernel."""
        table = self._table(x)
        if fused_ops.applies(x) and x.stride(-1) == 1:
            return fused_ops.rotary_inplace(x, positions, table)
        cos = table[0].index_select(0, positions).unsqueeze(1)
        sin = table[1].index_select(0, positions).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused_ops.applies(gate_up) and gate_up.dim() == 2:
            return self.down_proj(fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
