"""Rotary position embedding (HF's rotate-half layout) with the checkpoint's scaling: default, linear,
llama3, or longrope (Phi-3: per-pair factors, `short_factor` for positions inside the original
context and `long_factor` beyond it, cos/sin scaled by the attention factor). With `rotary_dim` below
the head size only the first `rotary_dim` features of each head rotate (partial rotary)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.config import rope_type
from tokenmill.kernels import fused_ops


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                             factors: list[float] | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, with rope scaling default, linear or llama3; `factors` (longrope)
    divide each pair's frequency."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if factors is not None:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
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
    """A precomputed cos/sin table indexed by token position, applied to queries and keys."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
        self.cos_sin: torch.Tensor | None = None  # built on first use, on the activations' device and dtype

    def _freqs(self) -> tuple[torch.Tensor, float]:
        """(angle of every pair at every position [max_positions, rotary_dim / 2], cos/sin scale)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        scaling, dim = self.scaling or {}, self.rotary_dim
        if rope_type(scaling) not in ("longrope", "su"):
            return torch.outer(positions, rope_inverse_frequencies(dim, self.theta, scaling)), 1.0
        original = scaling["original_max_position_embeddings"]
        short = rope_inverse_frequencies(dim, self.theta, None, scaling["short_factor"])
        long = rope_inverse_frequencies(dim, self.theta, None, scaling["long_factor"])
        inv_freq = torch.where((positions < original)[:, None], short, long)
        factor = scaling.get("factor") or self.max_positions / original
        scale = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return positions[:, None] * inv_freq, scale

    def _table(self, like: torch.Tensor) -> torch.Tensor:
        if self.cos_sin is None or self.cos_sin.device != like.device or self.cos_sin.dtype != like.dtype:
            with torch.device("cpu"):
                freqs, scale = self._freqs()
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_sin = (torch.stack((emb.cos(), emb.sin())) * scale).to(like.device, like.dtype)
        return self.cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, heads, D] (queries and keys stacked along heads) at `positions`: [T].
        On CPU float32 the (whole-head) rotation is done in place by a fused kernel."""
        table = self._table(x)
        if fused_ops.applies(x) and x.stride(-1) == 1 and self.rotary_dim == x.shape[-1]:
            return fused_ops.rotary_inplace(x, positions, table)
        cos = table[0].index_select(0, positions).unsqueeze(1)
        sin = table[1].index_select(0, positions).unsqueeze(1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        return rotated if not rest.shape[-1] else torch.cat((rotated, rest), dim=-1)
