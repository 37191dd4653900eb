"""DeepSeek-V2 / V3 (and Kimi-K2, which is a DeepSeek-V3): only the math.

Multi-head latent attention (`layers.mla`: the cache holds one latent + rope key per token) with
interleaved rotary pairs and yarn scaling (the softmax scale grows by mscale(factor, mscale_all_dim)^2);
the first `first_k_dense_replace` layers have a dense MLP, the rest a routed set of experts plus
`n_shared_experts` always-on experts. Routing: V2 softmax scores, top-k greedy or group-limited (a
group scores its best expert); V3 sigmoid scores with a correction bias for choosing only, the best
`topk_group` of `n_group` groups by their top-2 sum, renormalised; both scaled by
`routed_scaling_factor`. Multi-token-prediction layers a checkpoint ships after the last layer
(`num_nextn_predict_layers`) are not loaded with the model (`tokenmill.spec_decode.mtp` loads them as a drafter).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig, rope_type
from tokenmill.layers.fused_moe import Routing, check_expert_counts
from tokenmill.layers.mla import MLAAttention
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, yarn_mscale
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, PreNormDecoderLayer, routed_experts
from tokenmill.models.utils import decoder_layers, load_checkpoint
from tokenmill.quantization.base import QuantizationConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class DeepseekConfig(ModelConfig):
    q_lora_rank: int | None = None  # None: queries straight from the hidden state
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_interleave: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    sparse_layers: tuple[int, ...] = ()
    routing: Routing | None = None
    routing_bias: bool = False  # V3: the router's e_score_correction_bias
    num_nextn_predict_layers: int = 0  # MTP layers after the last decoder layer
    mtp_sparse: bool = False  # whether the first MTP layer's MLP is routed experts

    def __post_init__(self) -> None:
        super().__post_init__()
        check_expert_counts(self.num_experts, self.num_experts_per_tok)

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
        layers, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
        first_dense, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        routed = [i for i in range(layers + 1) if cfg.get("n_routed_experts") and i >= first_dense and i % freq == 0]
        sparse, mtp_sparse = tuple(i for i in routed if i < layers), bool(mtp) and layers in routed
        experts = (
            cfg["n_routed_experts"] if sparse or mtp_sparse else 0
        )  # a dense-only config names experts it never uses
        groups = cfg.get("n_group") or 1
        grouped = groups > 1 and (v3 or cfg.get("topk_method") == "group_limited_greedy")
        routing = Routing(
            cfg.get("num_experts_per_tok") or 1,
            renormalize=bool(cfg.get("norm_topk_prob")),
            scoring="sigmoid" if v3 else "softmax",
            num_groups=groups if grouped else 1,
            topk_groups=cfg.get("topk_group") or 1 if grouped else 1,
            group_score="top2" if v3 else "max",
            scale=float(cfg.get("routed_scaling_factor", 1.0)),
        )
        return dict(
            num_key_value_heads=cfg["num_attention_heads"],  # every head reads the one latent
            head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            rope_interleave=cfg.get("rope_interleave", True) if v3 else True,
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            sparse_layers=sparse,
            routing=routing,
            routing_bias=v3,
            num_nextn_predict_layers=mtp,
            mtp_sparse=mtp_sparse,
        )


class DeepseekMoE(nn.Module):
    """Routed experts (router `gate`, V3's selection bias beside it) plus the shared experts."""

    def __init__(self, config: DeepseekConfig, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.gate, self.experts = routed_experts(config, config.routing, quant_config, prefix)
        if config.routing_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
            )
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(
                config, quant_config, f"{prefix}.shared_experts", config.moe_intermediate_size * config.n_shared_experts
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(
            x,
            self.gate(x),
            getattr(self, "e_score_correction_bias", None),
            shared=getattr(self, "shared_experts", None),
        )


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: DeepseekConfig,
        rotary: RotaryEmbedding,
        scale: float,
        quant_config: QuantizationConfig,
        prefix: str,
        layer: int,
    ) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.q_lora_rank,
            c.kv_lora_rank,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            rotary,
            scale,
            c.attention_bias,
            c.rms_norm_eps,
            quant_config,
            f"{prefix}.self_attn",
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        sparse = layer in c.sparse_layers
        self.mlp = (
            DeepseekMoE(c, quant_config, f"{prefix}.mlp") if sparse else LlamaMLP(c, quant_config, f"{prefix}.mlp")
        )


class DeepseekModel(LlamaModel):
    def build_layers(
        self, config: DeepseekConfig, quant_config: QuantizationConfig, max_positions: int
    ) -> list[nn.Module]:
        rotary, scale = mla_rotary_and_scale(config, max_positions)
        return decoder_layers(
            config.num_hidden_layers,
            lambda i: DeepseekDecoderLayer(config, rotary, scale, quant_config, f"model.layers.{i}", i),
        )


def mla_rotary_and_scale(c: DeepseekConfig, max_positions: int) -> tuple[RotaryEmbedding, float]:
    """The rotation of the rope part of keys and queries, and the softmax scale (yarn: times mscale^2)."""
    rotary = RotaryEmbedding(
        c.qk_rope_head_dim, max_positions, c.rope_theta, c.rope_scaling, interleaved=c.rope_interleave
    )
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    scaling = c.rope_scaling or {}
    if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return rotary, scale


class DeepseekForCausalLM(LlamaForCausalLM):
    config_class = DeepseekConfig
    packed_modules = {"gate_up_proj": ["gate_proj", "up_proj"], "kv_b_proj": ["k_b_proj", "v_b_proj"]}
    checkpoint_renames = {".gate.e_score_correction_bias": ".e_score_correction_bias"}
    decoder_class = DeepseekModel

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Everything but the multi-token-prediction layers numbered after the last decoder layer."""

        def is_mtp(name: str) -> bool:
            m = _LAYER.match(name)
            return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

        load_checkpoint(self, ((n, w) for n, w in weights if not is_mtp(n)))
