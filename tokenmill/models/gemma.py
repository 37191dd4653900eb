"""Gemma 2 and Gemma 3 (text) decoders: only the math.

Against Llama: embeddings scaled by sqrt(hidden), RMSNorm as x / rms(x) * (1 + weight), a norm
before *and* after both attention and MLP, GeGLU (tanh) MLPs, attention scaled by
query_pre_attn_scalar^-1/2, sliding-window layers interleaved with global ones (`layer_types`),
and soft-capped attention scores and final logits where the config has them (Gemma 2). Gemma 3
adds RMSNorm over each head's q and k, and a rope base of its own for the sliding layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.config import rope_type
from tokenmill.kernels.decode_step import LayerParts
from tokenmill.layers.activation import gelu_tanh_and_mul
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.forward_context import counts_experts, current_lora_batch
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM, LlamaMLP, compiled_decode, layer_parts
from tokenmill.models.utils import decoder_layers
from tokenmill.quantization.base import QuantizationConfig, dense
from tokenmill.quantization.unquantized import load_dense

SLIDING, FULL = "sliding_attention", "full_attention"
_WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}  # every Nth layer is global


@dataclass
class GemmaConfig(LlamaConfig):
    supported_activations: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh",)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float = 10000.0  # rope base of the sliding layers (rope_theta: the global ones)
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"model config: layer_types must give {SLIDING!r} or {FULL!r} for each of the "
                f"{self.num_hidden_layers} layers"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("model config: sliding_attention layers need a sliding_window")

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        arch, layers = cfg["architectures"][0], cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern") or _WINDOW_PATTERN[arch]
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        rope = cfg.get("rope_parameters") or {}
        full, local = (rope.get(FULL), rope.get(SLIDING)) if FULL in rope else (rope, rope)
        full, local = full or {}, local or {}
        scaling = cfg.get("rope_scaling") or (full if rope_type(full) != "default" else None)
        return dict(
            qkv_bias=cfg.get("attention_bias", False),
            o_bias=cfg.get("attention_bias", False),
            mlp_bias=False,
            qk_norm=arch == "Gemma3ForCausalLM",
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            layer_types=tuple(types),
            sliding_window=cfg.get("sliding_window"),
            rope_theta=cfg.get("rope_theta") or full.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            rope_local_theta=cfg.get("rope_local_base_freq") or local.get("rope_theta", 10000.0),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): checkpoints store w, kept here as 1 + w so the plain (fused) norm applies."""

    def weight_loader(self, kind: str, weight, shard: int | None = None) -> None:
        load_dense(self.weight, dense(weight).float() + 1.0, slice(None), (slice(None),))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: GemmaConfig, rotary: RotaryEmbedding, quant_config: QuantizationConfig, prefix: str, sliding: bool
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(
            config,
            rotary,
            quant_config,
            f"{prefix}.self_attn",
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if sliding else None,
            soft_cap=config.attn_logit_softcapping,
            norm=GemmaRMSNorm,
        )
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp", act_and_mul=gelu_tanh_and_mul)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, hidden, residual):
        """The stream is hidden + residual (residual None before the first layer)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden, _ = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual

    def decode_parts(self) -> LayerParts:
        """This layer for the compiled decode step."""
        return layer_parts(
            self.input_layernorm,
            self.self_attn,
            self.pre_feedforward_layernorm,
            self.mlp,
            attn_out_norm=self.post_attention_layernorm,
            mlp_out_norm=self.post_feedforward_layernorm,
            activation="gelu_tanh",
        )


class GemmaModel(nn.Module):
    def __init__(self, config: GemmaConfig, quant_config: QuantizationConfig, max_positions: int) -> None:
        super().__init__()
        full = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        local = RotaryEmbedding(config.head_dim, max_positions, config.rope_local_theta)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        sliding = [kind == SLIDING for kind in config.layer_types]
        self.layers = nn.ModuleList(
            decoder_layers(
                len(sliding),
                lambda i: GemmaDecoderLayer(
                    config, local if sliding[i] else full, quant_config, f"model.layers.{i}", sliding[i]
                ),
            )
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.compiled_decode = (None, None)  # (for cache, step): `models.llama.compiled_decode`

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        hidden, residual = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype), None
        step, metas = compiled_decode(self, self.layers, hidden)
        if step is not None:
            hidden, residual = step(positions, hidden, residual, metas, current_lora_batch(), counts_experts())
        else:
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(LlamaForCausalLM):
    config_class = GemmaConfig
    decoder_class = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
