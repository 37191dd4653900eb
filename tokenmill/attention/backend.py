"""The interface every attention backend implements (the choice of one is `selector.py`).

A backend owns the shape of a layer's KV cache, turns the runner's `CommonAttentionMetadata` into
its own per-step metadata (once per step, shared by its layers), and runs attention: write the
step's new K/V into the layer's cache at `slot_mapping`, then attend over cached + new tokens under
the causal mask. An int8 / fp8 cache has a scales tensor beside it (`tokenmill.attention.kv_quant`):
the backend quantizes as it writes and dequantizes as it reads. Backends: `torch_sdpa` (plain
PyTorch, CPU and CUDA) and `cpu_paged` (a compiled paged decode kernel, CPU float32); with context parallelism
`context_parallel` (each rank's stripe of the cache, merged over the ranks). GPU kernels plug
in here, and into `selector.get_attention_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.kv_spec import AttentionSpec
from tokenmill.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from tokenmill.attention.context_parallel import TokenSplit


class AttentionBackend(ABC):
    name: str
    supported_features: tuple[str, ...] = ()  # of "sliding_window", "logits_soft_cap", "sinks"

    def kv_cache_shape(self, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        """One layer's cache: K and V of every slot of every block (a latent spec: one tensor, values
        read from its first features). A quantized cache's scales: this shape without the last dim."""
        return (spec.num_tensors, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def check_layer(self, layer) -> None:
        """Raise if this backend cannot run the attention layer `layer` (e.g. a sliding window)."""
        for feature in ("sliding_window", "logits_soft_cap", "sinks"):
            if getattr(layer, feature) is not None and feature not in self.supported_features:
                raise ValueError(f"attention backend {self.name} does not support {feature} ({layer.layer_name})")

    def token_split(self, common: CommonAttentionMetadata) -> TokenSplit | None:
        """Which of the step's tokens each rank runs (prefill context parallelism splits them:
        `context_parallel.py`); None: this rank runs every token."""
        return None

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, sliding_window: int | None = None):
        """This backend's metadata for one step, for the layers of one KV-cache group (a sliding
        window, if they have one: each query sees only the last `sliding_window` positions)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta,
        scale: float,
        soft_cap: float | None = None,
        kv_scales: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new K/V into `kv_cache`, attend (scores soft-capped: cap * tanh(s / cap), if set).
        q: [T, H, D]; k, v: [T, KVH, D]; kv_scales: an int8 / fp8 cache's scales; sinks: [H] float32,
        each head's extra softmax logit with no value. Returns [T, H, D]."""

    def forward_rotary(self, positions: torch.Tensor, rotary, qk: torch.Tensor, v: torch.Tensor, *rest) -> torch.Tensor:
        """`forward` after rotating the queries and keys, stacked in `qk` [T, H + KVH, D], with `rotary` (a
        `layers.rotary.RotaryEmbedding`) at `positions` [T]; `rest`: `forward`'s arguments after `v`
        (kv_cache, meta, scale, soft_cap, kv_scales, sinks), in its order. Here one rotation then `forward`;
        a backend with a fused kernel overrides it to rotate and write the cache in one pass (`triton-paged`)."""
        q, k = rotary(positions, qk).split([qk.shape[1] - v.shape[1], v.shape[1]], dim=1)
        return self.forward(q, k, v, *rest)
