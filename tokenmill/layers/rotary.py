"""Rotary position embedding (HF's rotate-half layout) with the checkpoint's scaling: default, linear,
llama3, yarn (DeepSeek: frequencies blended between interpolated and original by a ramp over the
pairs, cos/sin scaled by the attention factor), or longrope (Phi-3: per-pair factors, `short_factor`
for positions inside the original context and `long_factor` beyond it, cos/sin scaled by the
attention factor). With `rotary_dim` below the head size only the first `rotary_dim` features of each
head rotate (partial rotary). `interleaved` (DeepSeek's layout) pairs features (0, 1), (2, 3), …
instead of (i, i + dim/2); the rotated features come out in rotate-half order, which leaves every
query-key dot product unchanged since queries and keys are reordered alike."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.config import rope_type
from tokenmill.kernels import fused_ops


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, factors: list[float] | None = None
) -> torch.Tensor:
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
    elif kind == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The cos/sin scale of yarn: given, or from the factor (and DeepSeek's mscale / mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Pairs that turn fast within the original context keep their frequency, slow ones are divided by
    the factor, and a linear ramp between the pairs of `beta_fast` and `beta_slow` rotations blends."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(fast), pair_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table indexed by token position, applied to queries and keys."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
        self.cos_sin: torch.Tensor | None = None  # built on first use, on the activations' device and dtype

    def _freqs(self) -> tuple[torch.Tensor, float]:
        """(angle of every pair at every position [max_positions, rotary_dim / 2], cos/sin scale)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        scaling, dim = self.scaling or {}, self.rotary_dim
        if rope_type(scaling) not in ("longrope", "su"):
            scale = yarn_attention_factor(scaling) if rope_type(scaling) == "yarn" else 1.0
            return torch.outer(positions, rope_inverse_frequencies(dim, self.theta, scaling)), scale
        original = scaling["original_max_position_embeddings"]
        short = rope_inverse_frequencies(dim, self.theta, None, scaling["short_factor"])
        long = rope_inverse_frequencies(dim, self.theta, None, scaling["long_factor"])
        inv_freq = torch.where((positions < original)[:, None], short, long)
        factor = scaling.get("factor") or self.max_positions / original
        scale = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
        return positions[:, None] * inv_freq, scale

    def table(self, like: torch.Tensor) -> torch.Tensor:
        """[2, max_positions, rotary_dim]: cos and sin of every pair (rotate-half order, each angle twice)
        at every position, times the scaling's factor, on `like`'s device and in its dtype."""
        if self.cos_sin is None or self.cos_sin.device != like.device or self.cos_sin.dtype != like.dtype:
            with torch.device("cpu"):
                freqs, scale = self._freqs()
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_sin = (torch.stack((emb.cos(), emb.sin())) * scale).to(like.device, like.dtype)
        return self.cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, heads, D] (queries and keys stacked along heads) at `positions`: [T].
        On CPU float32 the rotation (of the first `rotary_dim` features) is done in place by a fused kernel."""
        table = self.table(x)
        if fused_ops.applies(x) and x.stride(-1) == 1 and not self.interleaved:
            return fused_ops.rotary_inplace(x, positions, table)
        cos = table[0].index_select(0, positions).unsqueeze(1)
        sin = table[1].index_select(0, positions).unsqueeze(1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        half = self.rotary_dim // 2
        rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        return rotated if not rest.shape[-1] else torch.cat((rotated, rest), dim=-1)
