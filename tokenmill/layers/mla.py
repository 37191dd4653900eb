"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), run in its absorbed form.

Each token's keys and values come from one compressed latent c (`kv_lora_rank` features, RMS-normed)
and one rotated key part k_r (`rope_dim`, shared by all heads): head h's key is [W_UK[h] c, k_r] and
its value W_UV[h] c. The KV cache stores only [c, k_r] per token (an `MLAAttentionSpec`), instead of
every head's full key and value. Attention never expands them: the no-rope part of each query is
projected into latent space (q_c = W_UK[h]^T q_nope), so score = q_c · c + q_r · k_r, and the
softmax-weighted latents are projected out per head by W_UV[h] afterwards. That is multi-query
attention over [c, k_r] rows (values: their first `kv_lora_rank` features), which every backend runs.

Under tensor parallelism each rank runs its share of the heads (query and kv_b projections split by
heads, `o_proj` by input columns with one all-reduce); the latent row is shared by every head, so
each rank computes and caches the whole of it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import parallel_state
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.quantization.base import QuantizationConfig, dense


class LatentKVProjection(nn.Module):
    """`kv_b_proj`, the latent -> (no-rope key, value) projection of every head, kept as the two
    per-head matrices absorption uses: `w_uk` [H, nope, latent] and `w_uv` [H, v, latent]. A
    checkpoint holds it fused (HF: [H * (nope + v), latent]) or split as llama.cpp writes it (shard 0
    `k_b` [H, latent, nope], shard 1 `v_b` [H, v, latent]). `heads`: the heads this rank keeps."""

    num_shards = 2

    def __init__(
        self, num_heads: int, kv_lora_rank: int, nope_dim: int, v_dim: int, heads: range | None = None
    ) -> None:
        super().__init__()
        self.shape = (num_heads, kv_lora_rank, nope_dim, v_dim)
        self.heads = slice(heads.start, heads.stop) if heads is not None else slice(None)
        local = len(range(num_heads)[self.heads])
        self.w_uk = nn.Parameter(torch.empty(local, nope_dim, kv_lora_rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(local, v_dim, kv_lora_rank), requires_grad=False)

    def checkpoint_keys(self) -> list[tuple[str, int]]:
        return [("weight", 0), ("weight", 1)]

    def weight_loader(self, kind: str, weight, shard: int | None) -> None:
        heads, rank, nope, v = self.shape
        w = dense(weight)
        want = {None: heads * (nope + v) * rank, 0: heads * rank * nope, 1: heads * v * rank}[shard]
        if kind != "weight" or w.numel() != want:
            raise ValueError(
                f"has shape {tuple(w.shape)}, expected {want} values for heads={heads}, "
                f"kv_lora_rank={rank}, qk_nope_head_dim={nope}, v_head_dim={v}"
            )
        mine = self.heads
        if shard is None:
            w = w.reshape(heads, nope + v, rank)[mine]
            self.w_uk.copy_(w[:, :nope])
            self.w_uv.copy_(w[:, nope:])
        elif shard == 0:
            self.w_uk.copy_(w.reshape(heads, rank, nope)[mine].transpose(1, 2))
        else:
            self.w_uv.copy_(w.reshape(heads, v, rank)[mine])


class MLAAttention(nn.Module):
    """Queries (directly, or through a low-rank `q_a_proj` -> norm -> `q_b_proj`), the joint latent +
    rope-key projection `kv_a_proj_with_mqa`, absorbed attention over the latent cache, `o_proj`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        rotary: RotaryEmbedding,
        scale: float,
        bias: bool,
        rms_norm_eps: float,
        quant_config: QuantizationConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        tp, rank = parallel_state.tp_size(), parallel_state.tp_rank()
        if num_heads % tp:
            raise ValueError(f"{prefix}: {num_heads} heads do not split over {tp} ranks")
        self.total_heads, self.num_heads, self.kv_lora_rank = num_heads, num_heads // tp, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        q_size = num_heads * (nope_dim + rope_dim)
        if q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias, quant_config, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_size, False, quant_config, f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden_size, q_size, False, quant_config, f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden_size, kv_lora_rank + rope_dim, bias, quant_config, f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        mine = range(rank * self.num_heads, (rank + 1) * self.num_heads)
        self.kv_b_proj = LatentKVProjection(num_heads, kv_lora_rank, nope_dim, v_dim, mine)
        self.o_proj = RowParallelLinear(num_heads * v_dim, hidden_size, bias, quant_config, f"{prefix}.o_proj")
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, kv_lora_rank + rope_dim, scale, 1, prefix=f"{prefix}.attn", latent_rope_dim=rope_dim
        )

    def expanded_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What every head's full key and value would take per token, against the latent row cached."""
        return self.total_heads * (self.nope_dim + self.rope_dim + self.v_dim) * dtype.itemsize

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        heads, rank = self.num_heads, self.kv_lora_rank
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q_nope, q_rope = q.view(-1, heads, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())[0]
        rotated = self.rotary(positions, torch.cat((q_rope, k_rope.unsqueeze(1)), dim=1))  # one rotation for both
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, rotated[:, :heads]), dim=-1)
        key = torch.cat((latent, rotated[:, heads]), dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
        out = self.attn(query, key, key[..., :rank])  # [T, H, rank]: softmax-weighted latents
        out = torch.bmm(out.transpose(0, 1), self.kv_b_proj.w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(-1, heads * self.v_dim))
