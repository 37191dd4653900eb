"""Llama-family decoder: only the math. Llama, Mistral, Qwen2, SmolLM; Qwen3 (RMSNorm on each head's
queries and keys); Phi-3 (fused q/k/v and gate/up in the checkpoint, longrope, partial rotary); and
the mixture-of-experts members, whose MLP is a routed set of experts in some or all layers: Mixtral,
Qwen2-MoE (plus a gated shared expert), Qwen3-MoE. A sliding window applies to the layers the
config names (`layer_types`), to every layer of Mistral/Mixtral/Phi-3 when it sets one, and to
Qwen2's layers from `max_window_layers` on with `use_sliding_window`.

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
from tokenmill.distributed import parallel_state
from tokenmill.distributed.pipeline import IntermediateTensors, PPMissingLayer
from tokenmill.kernels.decode_step import CompiledDecode, LayerParts
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_context import counts_experts, current_lora_batch, get_forward_context
from tokenmill.layers.fused_moe import FusedMoE, Routing, check_expert_counts
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.utils import decoder_layers, load_checkpoint
from tokenmill.quantization.base import QuantizationConfig


@dataclass
class LlamaConfig(ModelConfig):
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before the rotation
    # mixture of experts (num_experts 0: every MLP is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token uses, gated
    sparse_layers: tuple[int, ...] = ()  # which layers' MLPs are experts
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers that attend only to the last `sliding_window` positions
    partial_rotary_factor: float = 1.0  # the fraction of each head's features that rotate

    def __post_init__(self) -> None:
        super().__post_init__()
        check_expert_counts(self.num_experts, self.num_experts_per_tok)

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        arch = cfg["architectures"][0]
        bias = cfg.get("attention_bias", False)
        fields = dict(
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        )
        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):  # q/k/v always carry a bias, o_proj never
            fields.update(qkv_bias=True, o_bias=False)
        layers = range(cfg["num_hidden_layers"])
        window, types = cfg.get("sliding_window"), cfg.get("layer_types")
        if types:
            windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
        elif arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
            windowed = list(layers)
        elif cfg.get("use_sliding_window"):
            windowed = [i for i in layers if i >= cfg.get("max_window_layers", 0)]
        else:
            windowed = []
        if window and windowed:
            fields.update(sliding_window=window, sliding_layers=tuple(windowed))
        rope = cfg.get("rope_parameters") or {}
        fields["partial_rotary_factor"] = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
        if arch == "MixtralForCausalLM":
            fields.update(
                num_experts=experts,
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True,
                sparse_layers=tuple(layers),
            )
        elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
            fields.update(
                num_experts=experts,
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=cfg.get("norm_topk_prob", False),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
            )
        return fields


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional RMSNorm of each head's q and k (`config.qk_norm`, with `norm`),
    rotation, attention (optionally windowed, soft-capped, with sinks), output projection. Shared by
    the model files of other families (Gemma, GPT-OSS)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig,
        prefix: str,
        scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, config.qkv_bias, quant_config, f"{prefix}.qkv_proj"
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, config.o_bias, quant_config, f"{prefix}.o_proj"
        )
        tp = self.qkv_proj.tp_size  # this rank's heads (kv heads replicated when fewer than ranks)
        self.num_heads, self.num_kv_heads = heads // tp, max(1, kv_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale or self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window,
            soft_cap,
            prefix=f"{prefix}.attn",
            sinks=sinks,
        )
        if config.qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if hasattr(self, "q_norm"):
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads])[0], self.k_norm(qk[:, self.num_heads :])[0]), 1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        return self.o_proj(self.attn.forward_rotary(positions, self.rotary, qk, v).view(-1, self.q_size))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (act: SiLU, or GELU-tanh for Gemma)."""

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantizationConfig,
        prefix: str,
        intermediate_size: int | None = None,
        act_and_mul=silu_and_mul,
    ) -> None:
        super().__init__()
        self.act_and_mul = act_and_mul
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, config.mlp_bias, quant_config, f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output, before the all-reduce (`RowParallelLinear.partial`)."""
        return self.down_proj.partial(self.act_and_mul(self.gate_up_proj(x)))


def routed_experts(
    config, routing: Routing, quant_config: QuantizationConfig, prefix: str
) -> tuple[ReplicatedLinear, FusedMoE]:
    """A MoE block's router (`gate`: a score per expert) and its experts (`experts`), as Qwen-MoE and
    DeepSeek checkpoints name them; `config` has `hidden_size`, `num_experts` and `moe_intermediate_size`."""
    gate = ReplicatedLinear(config.hidden_size, config.num_experts, False, quant_config, f"{prefix}.gate")
    experts = FusedMoE(
        config.num_experts,
        routing,
        config.hidden_size,
        config.moe_intermediate_size,
        f"{prefix}.experts",
        method=quant_config.expert_method(f"{prefix}.experts"),
    )
    return gate, experts


class LlamaSparseMoeBlock(nn.Module):
    """Each token through its top-k experts (router `gate`), plus a shared expert scaled by
    sigmoid(shared_expert_gate(x)) where the model has one."""

    def __init__(self, config: LlamaConfig, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        routing = Routing(config.num_experts_per_tok, config.norm_topk_prob)
        self.gate, self.experts = routed_experts(config, routing, quant_config, prefix)
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(
                config, quant_config, f"{prefix}.shared_expert", config.shared_expert_intermediate_size
            )
            self.shared_expert_gate = ReplicatedLinear(
                config.hidden_size, 1, False, quant_config, f"{prefix}.shared_expert_gate"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "shared_expert"):
            return self.experts(x, self.gate(x))
        return self.experts(
            x, self.gate(x), shared=self.shared_expert, shared_scale=torch.sigmoid(self.shared_expert_gate(x))
        )


class PreNormDecoderLayer(nn.Module):
    """The residual stream of a pre-norm decoder layer: norm, attention, add; norm, MLP, add (the adds
    fused into the next norm). Subclasses build `input_layernorm`, `self_attn`,
    `post_attention_layernorm` and `mlp` (Llama, DeepSeek, GPT-OSS)."""

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, config: LlamaConfig, rotary: RotaryEmbedding, quant_config: QuantizationConfig, prefix: str, layer: int
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        window = config.sliding_window if layer in config.sliding_layers else None
        self.self_attn = LlamaAttention(config, rotary, quant_config, f"{prefix}.self_attn", sliding_window=window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.num_experts and layer in config.sparse_layers
        self.mlp = (LlamaSparseMoeBlock if sparse else LlamaMLP)(config, quant_config, f"{prefix}.mlp")

    def decode_parts(self) -> LayerParts | None:
        """This layer for the compiled decode step, or None when it has parts the step lacks."""
        mlp, norms = self.mlp, (self.input_layernorm, self.self_attn, self.post_attention_layernorm)
        if type(mlp) is LlamaSparseMoeBlock:  # routed experts, and a shared one where it has one
            shared = getattr(mlp, "shared_expert", None)
            if mlp.experts.activation is not silu_and_mul or (shared and shared.act_and_mul is not silu_and_mul):
                return None
            gate = getattr(mlp, "shared_expert_gate", None)
            return layer_parts(*norms, shared, experts=mlp.experts, router=mlp.gate, shared_gate=gate)
        if type(mlp) is not LlamaMLP or mlp.act_and_mul is not silu_and_mul:
            return None
        return layer_parts(*norms, mlp)


def layer_parts(
    input_norm: nn.Module, attn: LlamaAttention, post_norm: nn.Module, mlp: LlamaMLP | None, **extra
) -> LayerParts:
    """A layer of these modules for the compiled decode step (with its q/k norms where it has them: Qwen3's,
    Gemma 3's; `mlp` None: a MoE layer without a shared expert); `extra`: `LayerParts`' other optional
    parts."""
    return LayerParts(
        input_norm,
        attn.qkv_proj,
        attn.rotary,
        attn.attn,
        attn.o_proj,
        post_norm,
        mlp and mlp.gate_up_proj,
        mlp and mlp.down_proj,
        getattr(attn, "q_norm", None),
        getattr(attn, "k_norm", None),
        **extra,
    )


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (`build_layers`: other families with the same residual stream
    build their own), final norm. A pipeline stage holds only its layers (`parallel_state.pp_layers`):
    the first starts from the embedding, the others from the previous stage's `IntermediateTensors`;
    all but the last return theirs instead of the normed hidden state."""

    def __init__(self, config: ModelConfig, quant_config: QuantizationConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        layers = self.build_layers(config, quant_config, max_positions)
        start, end = parallel_state.pp_layers(len(layers))
        self.layers = nn.ModuleList(layer if start <= i < end else PPMissingLayer() for i, layer in enumerate(layers))
        self.stage_layers = tuple(self.layers[start:end])  # this pipeline stage's (every layer without one)
        self.last_stage = end == len(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.compiled_decode: tuple[torch.Tensor | None, CompiledDecode | None] = (None, None)  # (for cache, step)
        # an EAGLE-3 drafter's ask: the residual stream entering these layers, kept by each forward in
        # `aux_hidden` [T, len(aux_layers) * hidden] (`_forward_keeping_aux`)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        self.aux_decode: tuple[tuple | None, list[CompiledDecode] | None] = (None, None)  # (for, steps)

    def build_layers(
        self, config: LlamaConfig, quant_config: QuantizationConfig, max_positions: int
    ) -> list[nn.Module]:
        rotary = RotaryEmbedding(
            config.head_dim,
            max_positions,
            config.rope_theta,
            config.rope_scaling,
            int(config.head_dim * config.partial_rotary_factor),
        )
        return decoder_layers(
            config.num_hidden_layers, lambda i: LlamaDecoderLayer(config, rotary, quant_config, f"model.layers.{i}", i)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        hidden, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        if self.aux_layers:  # an EAGLE-3 drafter's target: one stage (speculation is refused with pipelines)
            return self.norm(*self._forward_keeping_aux(positions, hidden))[0]
        step, metas = self._compiled_decode(hidden)
        if step is not None:
            hidden, residual = step(positions, hidden, residual, metas, current_lora_batch(), counts_experts())
        else:
            for layer in self.stage_layers:
                hidden, residual = layer(positions, hidden, residual)
        if not self.last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _forward_keeping_aux(self, positions: torch.Tensor, hidden: torch.Tensor):
        """The layers, keeping the residual stream entering each of `aux_layers` in `aux_hidden`; a
        step of decodes runs the stretches between them as compiled decode steps."""
        bounds = sorted({0, len(self.layers), *self.aux_layers})
        steps, metas = self._compiled_stretches(hidden, bounds)
        residual, aux = None, []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if start in self.aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            if steps is not None:
                hidden, residual = steps[i](positions, hidden, residual, metas, current_lora_batch(), counts_experts())
                continue
            for layer in self.layers[start:end]:
                hidden, residual = layer(positions, hidden, residual)
        self.aux_hidden = torch.cat(aux, dim=-1)
        return hidden, residual

    def _compiled_stretches(
        self, hidden: torch.Tensor, bounds: list[int]
    ) -> tuple[list[CompiledDecode] | None, object]:
        """`_compiled_decode` for the layers between `bounds`: one compiled step each, or (None, None)."""
        attn = getattr(getattr(self.layers[0], "self_attn", None), "attn", None)
        if attn is None or attn.kv_cache is None:
            return None, None
        built_for, steps = self.aux_decode
        if built_for is None or built_for[0] is not attn.kv_cache or built_for[1] != bounds:
            parts = [getattr(layer, "decode_parts", lambda: None)() for layer in self.layers]
            steps = [CompiledDecode.build(parts[a:b]) for a, b in zip(bounds, bounds[1:])]
            steps = None if None in steps else steps
            self.aux_decode = ((attn.kv_cache, bounds), steps)
        if steps is None:
            return None, None
        metas = step_metadata(steps[0])
        return (steps, metas) if all(s.applies(hidden, s.kv_cache, metas) for s in steps) else (None, None)

    def _compiled_decode(self, hidden: torch.Tensor) -> tuple[CompiledDecode | None, list | None]:
        return compiled_decode(self, self.stage_layers, hidden)


def step_metadata(step: CompiledDecode) -> list:
    """This step's attention metadata of each KV cache group the compiled `step` reads."""
    attn_metadata = get_forward_context().attn_metadata
    return [attn_metadata[g] for g in step.groups]


def compiled_decode(model: nn.Module, layers, hidden: torch.Tensor) -> tuple[CompiledDecode | None, list | None]:
    """The compiled decode step of `layers` (built on the first step after the KV cache is bound, kept in
    `model.compiled_decode`) and its metadata, when it runs every layer and this step is decodes only,
    or decodes and prompt chunks it runs (LoRA adapters included: it adds their deltas); else (None, None)."""
    attn = getattr(getattr(layers[0], "self_attn", None), "attn", None)
    if attn is None or attn.kv_cache is None:
        return None, None
    built_for, step = model.compiled_decode
    if built_for is not attn.kv_cache:
        step = CompiledDecode.build([getattr(layer, "decode_parts", lambda: None)() for layer in layers])
        model.compiled_decode = (attn.kv_cache, step)
    if step is None:
        return None, None
    metas = step_metadata(step)
    return (step, metas) if step.applies(hidden, attn.kv_cache, metas) else (None, None)


class LlamaForCausalLM(nn.Module):
    config_class = LlamaConfig
    # checkpoint modules that our fused layers hold, in shard order
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # Mixtral's name for the MoE block
    decoder_class = LlamaModel

    def __init__(self, config: LlamaConfig, quant_config: QuantizationConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_class(config, quant_config, max_positions)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, quant_config)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [T] for the whole flat batch. Returns final hidden states [T, hidden]
        (a pipeline stage before the last: its `IntermediateTensors`, from the previous stage's)."""
        if intermediate is None:  # decoders that do not split into stages (Gemma) take no third argument
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """The checkpoint's tensors; an embedding checkpoint saved from the bare decoder (Qwen3-Embedding)
        names them without the decoder's `model.` prefix."""
        load_checkpoint(self, ((n if n.startswith(("model.", "lm_head.")) else f"model.{n}", w) for n, w in weights))
