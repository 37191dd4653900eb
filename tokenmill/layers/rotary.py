"""Rotary position embedding (HF's rotate-half layout) with the checkpoint's scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.config import rope_type
from tokenmill.kernels import fused_ops


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with rope scaling default, linear or llama3."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.cos_sin: torch.Tensor | None = None  # built on first use, on the activations' device and dtype

    def _table(self, like: torch.Tensor) -> torch.Tensor:
        if self.cos_sin is None or self.cos_sin.device != like.device or self.cos_sin.dtype != like.dtype:
            with torch.device("cpu"):
                inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
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
