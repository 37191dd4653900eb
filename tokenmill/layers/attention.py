"""`Attention`: one module per attention layer of a model. It declares what the layer stores in the
KV cache (`kv_spec`), is bound to its cache tensor and backend by the model runner (which finds
these modules by type), and runs the backend on the step's metadata. With `latent_rope_dim` set it is
multi-head latent attention in its absorbed form: one shared key row per token (`head_dim` features,
the last `latent_rope_dim` of them rotated) whose leading features are also the value. A quantized
(int8 / fp8) cache comes with its scales tensor (`kv_scales`; a latent cache has one scale per token
row, which its values share). With `sinks` each query head has a learned logit (the `sinks` parameter,
[heads]: GPT-OSS) that joins its softmax's denominator without a value, so a head may attend to
nothing."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.kv_spec import AttentionSpec, MLAAttentionSpec
from tokenmill.distributed import parallel_state
from tokenmill.layers.forward_context import get_forward_context
from tokenmill.quantization.base import dense


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        prefix: str = "",
        latent_rope_dim: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.latent_rope_dim = latent_rope_dim
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # [2, blocks, block_size, kv heads] for an int8 / fp8 cache
        self.backend = None
        self.kv_group = 0
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None

    def weight_loader(self, kind: str, weight: torch.Tensor, shard=None) -> None:
        """The checkpoint's `sinks` of every head: this tensor-parallel rank keeps its heads'."""
        if kind != "sinks" or self.sinks is None:
            raise ValueError(f"is a {kind!r} tensor, which attention layers do not hold")
        first = parallel_state.tp_rank() * self.num_heads
        if weight.shape[0] < first + self.num_heads:
            raise ValueError(
                f"has shape {tuple(weight.shape)}, expected {self.num_heads * parallel_state.tp_size()} heads"
            )
        self.sinks.data.copy_(dense(weight)[first : first + self.num_heads])

    def kv_spec(self, cache_dtype: torch.dtype) -> AttentionSpec:
        """What a token stores. Decode context parallelism over the tensor-parallel ranks stores every
        rank's kv heads (for 1/N of the tokens: `tokenmill.attention.context_parallel`)."""
        if self.latent_rope_dim is not None:
            return MLAAttentionSpec(1, self.head_dim, cache_dtype, self.sliding_window, self.latent_rope_dim)
        heads = self.num_kv_heads * (parallel_state.tp_size() if parallel_state.cp_size() > 1 else 1)
        return AttentionSpec(heads, self.head_dim, cache_dtype, self.sliding_window)

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, backend, kv_group: int, kv_scales: torch.Tensor | None = None
    ) -> None:
        backend.check_layer(self)
        self.kv_cache, self.backend, self.kv_group, self.kv_scales = kv_cache, backend, kv_group, kv_scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv heads, D] -> [T, heads, D] (latent: v is k's leading
        features, a view of it, and the output has v's width)."""
        meta = get_forward_context().attn_metadata[self.kv_group]
        return self.backend.forward(
            q, k, v, self.kv_cache, meta, self.scale, self.logits_soft_cap, self.kv_scales, self.sinks
        )

    def forward_rotary(self, positions: torch.Tensor, rotary, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`forward` on queries and keys stacked in `qk` [T, heads + kv heads, D], not yet rotated: the
        backend rotates them with `rotary` (a `RotaryEmbedding`) at `positions`, in one kernel with the
        cache write where it has one."""
        meta = get_forward_context().attn_metadata[self.kv_group]
        return self.backend.forward_rotary(
            positions, rotary, qk, v, self.kv_cache, meta, self.scale, self.logits_soft_cap, self.kv_scales, self.sinks
        )
