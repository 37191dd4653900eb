"""GPT-OSS (OpenAI's open-weight MoE): only the math.

A Llama-shaped decoder whose attention layers alternate between a sliding window and full context
(`layer_types`), carry biases on q/k/v/o, and give each head a learned sink logit that joins its
softmax without a value (`Attention(sinks=True)`); rotary positions with yarn scaling. Every MLP is
a set of routed experts: a router with a bias, the top-k of its logits weighted by their softmax,
experts with biases on both projections and a clamped SwiGLU (`clamped_swiglu`).

The checkpoint stores each layer's experts stacked: `gate_up_proj` [E, H, 2I] with the gate and up
features interleaved (even columns gate, odd up), `down_proj` [E, I, H], their biases, and in the
released MXFP4 form `*_blocks` / `*_scales` [E, out, in / 32, 16] / [E, out, in / 32] instead of the
two weights. `load_weights` turns them into the experts' own layout (`layers.fused_moe`): dense
tensors of every expert, or one expert's FP4 `Codes` at a time for the experts' MXFP4 format.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.decode_step import LayerParts
from tokenmill.layers.activation import clamped_swiglu
from tokenmill.layers.fused_moe import FusedMoE, Routing
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    PreNormDecoderLayer,
    layer_parts,
)
from tokenmill.models.utils import decoder_layers
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.fp4 import e8m0_codes
from tokenmill.quantization.gguf_codes import Codes


@dataclass
class GptOssConfig(LlamaConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        fields = super().architecture_fields(cfg)  # biases, the sliding layers
        fields.update(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=tuple(range(cfg["num_hidden_layers"])),
            swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
            swiglu_limit=cfg.get("swiglu_limit", 7.0),
        )
        return fields


class GptOssMoE(nn.Module):
    """The router (with a bias) and the experts: softmax over the top-k logits is the top-k of the
    softmax renormalised."""

    def __init__(self, config: GptOssConfig, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_experts, True, quant_config, f"{prefix}.router")
        activation = functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        self.experts = FusedMoE(
            config.num_experts,
            Routing(config.num_experts_per_tok, renormalize=True),
            config.hidden_size,
            config.moe_intermediate_size,
            f"{prefix}.experts",
            bias=True,
            activation=activation,
            method=quant_config.expert_method(f"{prefix}.experts"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, config: GptOssConfig, rotary: RotaryEmbedding, quant_config: QuantizationConfig, prefix: str, layer: int
    ) -> None:
        super().__init__()
        window = config.sliding_window if layer in config.sliding_layers else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, rotary, quant_config, f"{prefix}.self_attn", sliding_window=window, sinks=True
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMoE(config, quant_config, f"{prefix}.mlp")

    def decode_parts(self) -> LayerParts | None:
        """This layer for the compiled decode step: sinks, routed experts with biases and the clamped SwiGLU."""
        act = self.mlp.experts.activation
        if not (isinstance(act, functools.partial) and act.func is clamped_swiglu):
            return None
        swiglu = (float(act.keywords["alpha"]), float(act.keywords["limit"]))
        parts = (self.input_layernorm, self.self_attn, self.post_attention_layernorm, None)
        return layer_parts(*parts, experts=self.mlp.experts, router=self.mlp.router, swiglu=swiglu)


class GptOssModel(LlamaModel):
    def build_layers(
        self, config: GptOssConfig, quant_config: QuantizationConfig, max_positions: int
    ) -> list[nn.Module]:
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        return decoder_layers(
            config.num_hidden_layers, lambda i: GptOssDecoderLayer(config, rotary, quant_config, f"model.layers.{i}", i)
        )


class GptOssForCausalLM(LlamaForCausalLM):
    config_class = GptOssConfig
    decoder_class = GptOssModel
    checkpoint_renames = {".self_attn.sinks": ".self_attn.attn.sinks"}

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        super().load_weights(expert_tensors(weights))


def expert_tensors(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each layer's stacked experts in per-projection form:
    `experts.gate_proj.weight` [E, I, H] and the like for dense ones, `experts.N.gate_proj.weight`
    as `Codes` for MXFP4 ones (blocks and scales paired up as they arrive)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts"):
            yield name, tensor
        elif leaf == "gate_up_proj":
            yield f"{prefix}.gate_proj.weight", tensor[..., 0::2].transpose(1, 2)
            yield f"{prefix}.up_proj.weight", tensor[..., 1::2].transpose(1, 2)
        elif leaf == "gate_up_proj_bias":
            yield f"{prefix}.gate_proj.bias", tensor[..., 0::2]
            yield f"{prefix}.up_proj.bias", tensor[..., 1::2]
        elif leaf == "down_proj":
            yield f"{prefix}.down_proj.weight", tensor.transpose(1, 2)
        elif leaf == "down_proj_bias":
            yield f"{prefix}.down_proj.bias", tensor
        elif leaf.endswith(("_blocks", "_scales")):
            proj, _, part = leaf.rpartition("_")
            parts = pending.setdefault(f"{prefix}.{proj}", {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[f"{prefix}.{proj}"]
                yield from _mxfp4_experts(prefix, proj, parts["blocks"], parts["scales"])
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"checkpoint has MXFP4 blocks without scales (or scales without blocks): {sorted(pending)}")


def _mxfp4_experts(prefix: str, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, Codes]]:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"checkpoint tensors {prefix}.{proj}_blocks {tuple(blocks.shape)} {blocks.dtype} and _scales "
            f"{tuple(scales.shape)} {scales.dtype} are not MXFP4 (uint8 [E, out, in / 32, 16] and "
            "[E, out, in / 32])"
        )
    for e in range(blocks.shape[0]):
        codes = e8m0_codes(blocks[e], scales[e])
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", codes
        else:  # rows interleave gate and up features
            yield f"{prefix}.{e}.gate_proj.weight", _rows(codes, slice(0, None, 2))
            yield f"{prefix}.{e}.up_proj.weight", _rows(codes, slice(1, None, 2))


def _rows(codes: Codes, rows: slice) -> Codes:
    return dataclasses.replace(
        codes,
        q=codes.q[rows],
        scales=codes.scales[rows],
        offsets=None if codes.offsets is None else codes.offsets[rows],
    )
