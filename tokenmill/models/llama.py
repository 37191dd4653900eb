"""Llama-family decoder (Llama, Mistral with full attention, Qwen2, SmolLM): only the math.

The forward pass takes a flat batch of tokens from many sequences (`input_ids`, `positions`; the
attention layers read which tokens belong to which sequence from the step's forward context);
nothing is padded in the linear layers, so prefill chunks and decode tokens share one pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.utils import load_checkpoint
from tokenmill.quantization.base import QuantizationConfig


@dataclass
class LlamaConfig(ModelConfig):
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act != "silu":
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        if cfg["architectures"][0] == "Qwen2ForCausalLM":  # q/k/v always carry a bias, o_proj never
            return dict(qkv_bias=True, o_bias=False, mlp_bias=cfg.get("mlp_bias", False))
        bias = cfg.get("attention_bias", False)
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=cfg.get("mlp_bias", False))


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, quant_config: QuantizationConfig,
                 prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                          config.qkv_bias, quant_config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, quant_config,
                                        f"{prefix}.o_proj")
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
                              prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = self.rotary(positions, qkv[:, : self.num_heads + self.num_kv_heads])  # one rotation for q and k
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        return self.o_proj(self.attn(q, k, v).view(-1, self.q_size))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, config: LlamaConfig, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, quant_config,
                                           f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, quant_config: QuantizationConfig,
                 prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, quant_config: QuantizationConfig, max_positions: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, quant_config, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    config_class = LlamaConfig
    # checkpoint modules that our fused layers hold, in shard order
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: LlamaConfig, quant_config: QuantizationConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, max_positions)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, quant_config)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for the whole flat batch. Returns final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        load_checkpoint(self, weights)
