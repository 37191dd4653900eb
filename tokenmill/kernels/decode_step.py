"""The decode (and mixed) step of a stack of pre-norm decoder layers in one C++ call, on CPU float32.

A decode step of a small model is thousands of tiny kernel calls: SmolLM2-135M runs 30 layers of
about ten each per token, and from Python every call costs more in module dispatch, argument
checks and temporaries than the kernel itself (about 40% of a token's time). This loop (csrc/decode_step.cpp) makes the
same calls from C++, layer by layer, to the very functions the Python path calls (they are linked
into the same extension, `tokenmill.kernels.cpu_kernels`), in the same order on the same inputs,
so its results are bit-identical to the module-by-module forward:

    RMSNorm(x + residual) -> qkv (+ bias) -> rotate q, k (rotate-half) -> write k, v to their slots
    -> paged decode attention -> o_proj -> RMSNorm(+ residual) -> gate_up -> silu * up -> down

and Gemma 2's and 3's layers (`LayerParts`' optional parts): each head's q and k normed before the
rotation, the attention's and the MLP's outputs normed before they join the stream, GELU-tanh for SiLU,
sliding-window layers beside global ones, each with its own KV cache group (block tables, slots) and
rotary table, soft-capped attention scores; a rotation of each head's first `rotary_dim` features
only (partial rotary, as Phi-4-mini's); and mixture-of-experts MLPs (Mixtral's, Qwen2/3-MoE's: a softmax
router's top-k, renormalised or not, each token's experts run grouped by expert, their outputs weighed
and summed, plus a shared expert scaled by its sigmoid gate; csrc/step_experts.cpp), op for op as
`FusedMoE.forward` computes them, the expert counters of /metrics included; and GPT-OSS's layers:
attention sinks, biased experts with a clamped SwiGLU.

Each linear layer is given by its `LinearMethod.decode_operands` (dense float32 weights, or GGUF
blocks with float or int8 activations), and with LoRA adapters by its `LoRAWeights` factors: a step
whose tokens run adapters adds their deltas after each matmul with the LoRA kernel the Python path
calls (`tokenmill.kernels.lora`), on the step's segments; a layer with anything else (other activations,
latent attention, grouped or sigmoid routing, tensor or expert parallelism, adapters beside MoE layers)
keeps the model's own forward. KV caches
may be float32, float16, bfloat16, or int8 / fp8 with their scales (written by `write_kv_quantized`,
bit for bit the torch path's quantizer, and read by the same decode kernel).

When every linear layer runs int8 activations on panels and no adapter (Gemma's parts included), the
layers run inside one OpenMP parallel region instead of one per kernel: about 150 fork/joins a token
fewer for SmolLM2 (a MoE layer's experts on panels too: its routing is one unit, its experts' gate_up and
down two products over the active experts' panels). Each layer is nine phases (csrc/step_phases.h): the
products split by panels, the attention by its tasks, the small ops one unit each; a thread takes its
share a piece at a time and then what a late partner has not started, so a thread preempted on a busy
host holds up no op. Each output element is still computed by the same code on the same inputs, so the
bits do not change. That region also runs mixed steps: the prompt chunks after the decodes, where the
backend would run each with its prefill kernel alone (`CpuPagedBackend.runs_prefill_kernel`), their
attention as that kernel's tasks (`PrefillAttention`), so a step that prefills beside its decodes has
no Python between its layers either.

The C++ step (`DecodeStep`) is built once with the layers' weights and KV caches, as `Linear` records:
a step passes only its own tensors (about 1,100 weight arguments a token fewer to convert for SmolLM2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.kernels import cpu_kernels, paged_attention


def load():
    """The compiled extension (`tokenmill.kernels.cpu_kernels`), or None when there is none here."""
    return cpu_kernels()


@dataclass
class LayerParts:
    """One decoder layer as the compiled step runs it (the modules of the model's own layer)."""

    input_norm: nn.Module  # RMSNorm
    qkv_proj: nn.Module
    rotary: nn.Module  # RotaryEmbedding
    attn: nn.Module  # Attention
    o_proj: nn.Module
    post_norm: nn.Module  # RMSNorm
    gate_up_proj: nn.Module | None  # the MLP's (a MoE layer's shared expert's: None where it has none)
    down_proj: nn.Module | None
    # Gemma 3's: RMSNorms of each head's q and k, and of the attention's and the MLP's output before the
    # stream takes them; its activation
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    attn_out_norm: nn.Module | None = None
    mlp_out_norm: nn.Module | None = None
    activation: str = "silu"  # or "gelu_tanh"
    # a mixture-of-experts layer's: its `FusedMoE`, router, and the gate of its shared expert (Qwen2-MoE's);
    # its experts' activation: SiLU * up, or GPT-OSS's clamped SwiGLU with these (alpha, limit)
    experts: nn.Module | None = None
    router: nn.Module | None = None
    shared_gate: nn.Module | None = None
    swiglu: tuple[float, float] | None = None


_NONE = torch.empty(0)
_ACTIVATIONS = ("silu", "gelu_tanh")


def _linear_operands(linear: nn.Module | None) -> tuple[list[torch.Tensor], list[int], int | None] | None:
    """(tensors, ints, the most tokens its kernel takes) of one linear layer (or of none: kind -1), or None
    if unsupported."""
    if linear is None:
        return [_NONE] * 8, [-1, 0, 0], None
    if getattr(linear, "tp_size", 1) != 1:
        return None
    operands = linear.quant_method.decode_operands(linear)
    if operands is None:
        return None
    kind, bits, center, tensors, max_tokens = operands
    bias = getattr(linear, "bias", None)
    return (
        [t if t is not None else _NONE for t in tensors] + [bias if bias is not None else _NONE],
        [kind, bits, center],
        max_tokens,
    )


def _dense_operands(weight: torch.Tensor) -> tuple[list[torch.Tensor], list[int], None] | None:
    """`_linear_operands` of a dense float32 weight [N, K] on the CPU (an expert's projection)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return [weight] + [_NONE] * 7, [0, 0, 0], None


def _expert_operands(p: LayerParts) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
    """(tensors, ints, token limits) of a MoE layer's `Experts` (csrc/decode_step.cpp's constructor), or None
    where the step lacks its routing or experts: sigmoid or grouped scores, scaled weights, experts split
    over ranks, SwiGLU experts beside a shared one."""
    moe, routing = p.experts, p.experts.routing
    if (
        (routing.scoring, routing.num_groups, routing.scale) != ("softmax", 1, 1.0)
        or (p.swiglu is not None and p.gate_up_proj is not None)
        or moe.expert_parallel
        or moe.share != moe.intermediate_size
        or len(moe.experts) != moe.num_experts
    ):
        return None
    if isinstance(moe.w13, nn.ModuleList):
        projections = [_linear_operands(m) for m in (*moe.w13, *moe.w2)]
    else:
        projections = [_dense_operands(w) for w in (*moe.w13, *moe.w2)]
    linears = [_linear_operands(p.router), _linear_operands(p.shared_gate), *projections]
    if any(op is None for op in linears):
        return None
    swiglu = _NONE if p.swiglu is None else torch.tensor(p.swiglu, dtype=torch.float64)
    biases = [b if b is not None else _NONE for b in (moe.w13_bias, moe.w2_bias)]
    tensors = [t for lt, _, _ in linears for t in lt] + [moe.expert_tokens, *biases, swiglu]
    ints = [moe.num_experts, routing.top_k, int(routing.renormalize)] + [i for _, li, _ in linears for i in li]
    return tensors, ints, [limit for _, _, limit in linears if limit]


class CompiledDecode:
    """Runs a stack of `LayerParts` for steps of decode tokens only (see the module docstring)."""

    def __init__(
        self,
        parts: list[LayerParts],
        tensors: list[torch.Tensor],
        ints: list[int],
        max_tokens: int | None,
        lora: list[torch.Tensor],
        experts: tuple[list[torch.Tensor], list[int]] = ([], []),
    ) -> None:
        first = parts[0]
        self.kv_cache = first.attn.kv_cache  # the first layer's cache when this was built
        self.kv_scales, self.backend = first.attn.kv_scales, first.attn.backend
        # the KV cache groups and rotary tables of the layers, the first layer's first
        self.groups = list(dict.fromkeys(p.attn.kv_group for p in parts))
        self.rotaries = list({id(p.rotary): p.rotary for p in parts}.values())
        self.tensors, self.ints, self.max_tokens, self.experts = tensors, ints, max_tokens, experts
        self.lora = lora  # per linear layer (a, b, shard_offsets) of its LoRAWeights; empty without LoRA
        self.num_heads, self.num_kv_heads, self.head_dim = (
            first.attn.num_heads,
            first.attn.num_kv_heads,
            first.attn.head_dim,
        )
        self.eps, self.scale = first.input_norm.eps, first.attn.scale
        self.soft_caps = [float(p.attn.logits_soft_cap or 0.0) for p in parts]  # Gemma 2's
        # the C++ step holding the weights (and this cache: a cache bound anew builds a new step, `applies`)
        self.step = load().DecodeStep(
            tensors,
            ints,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
            self.soft_caps,
            lora,
            *experts,
        )

    @classmethod
    def build(cls, parts: list[LayerParts | None]) -> CompiledDecode | None:
        """The compiled step for these layers, or None when some layer has a part it does not run."""
        # CPU tensors only: the device is checked first, so a GPU model never builds (compiles) the extension
        if not parts or any(p is None for p in parts) or parts[0].attn.kv_cache.device.type != "cpu" or load() is None:
            return None
        first = parts[0].attn
        groups = list(dict.fromkeys(p.attn.kv_group for p in parts))
        rotaries = list({id(p.rotary): p.rotary for p in parts}.values())
        tensors, ints, limits, lora, expert_tensors, expert_ints = [], [], [], [], [], []
        moe_layers = 0
        for p in parts:
            a = p.attn
            same = (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) == (
                first.num_heads,
                first.num_kv_heads,
                first.head_dim,
                first.scale,
            )
            norms = (p.input_norm, p.post_norm, p.q_norm, p.k_norm, p.attn_out_norm, p.mlp_out_norm)
            if (
                not same
                or {n.eps for n in norms if n is not None} != {parts[0].input_norm.eps}
                or (p.q_norm is None) != (p.k_norm is None)
                or p.activation not in _ACTIVATIONS
                or a.kv_cache is None
                or a.kv_cache.dtype not in paged_attention.CACHE_DTYPES
                or a.kv_cache.device.type != "cpu"
                or getattr(a.backend, "name", None) != "cpu-paged"
                or a.latent_rope_dim is not None
                or p.rotary.interleaved
            ):
                return None
            modules = (p.qkv_proj, p.o_proj, p.gate_up_proj, p.down_proj)
            linears = [_linear_operands(m) for m in modules]
            if any(op is None for op in linears):
                return None
            lora += [
                t
                for m in modules
                if m is not None and m.lora is not None
                for t in (m.lora.a, m.lora.b, m.lora.shard_offsets)
            ]
            moe = -1  # this layer's experts: an index into the MoE layers'
            if p.experts is not None:
                operands = _expert_operands(p)
                if operands is None:
                    return None
                moe, moe_layers = moe_layers, moe_layers + 1
                expert_tensors += operands[0]
                expert_ints += operands[1]
                limits += operands[2]
            scales = (_NONE, _NONE) if a.kv_scales is None else (a.kv_scales[0], a.kv_scales[1])
            tensors += [p.input_norm.weight, p.post_norm.weight, a.kv_cache[0], a.kv_cache[1], *scales]
            for lt, li, limit in linears:
                tensors += lt
                ints += li
                limits += [limit] if limit else []
            tensors.append(a.sinks if a.sinks is not None else _NONE)
            tensors += [n.weight if n is not None else _NONE for n in norms[2:]]
            ints += [
                _ACTIVATIONS.index(p.activation),
                a.sliding_window or 0,
                groups.index(a.kv_group),
                next(i for i, r in enumerate(rotaries) if r is p.rotary),
                moe,
            ]
        if len(lora) not in (0, 12 * len(parts)) or (lora and moe_layers):  # adapters on some layers, or beside MoE
            return None
        return cls(parts, tensors, ints, min(limits) if limits else None, lora, (expert_tensors, expert_ints))

    def applies(self, hidden: torch.Tensor, kv_cache: torch.Tensor | None, metas: list) -> bool:
        """Whether this step can run compiled (`metas`: the step's attention metadata of each of `groups`):
        its decodes, and the prompt chunks after them where the step runs in one parallel region (every
        product on panels, no adapter) and the backend would run each chunk, in every group, with its
        prefill kernel alone; few enough tokens for every kernel."""
        if not (
            kv_cache is self.kv_cache
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and all(hasattr(m, "num_decodes") for m in metas)  # the CPU backends' metadata
            and (self.max_tokens is None or hidden.shape[0] <= self.max_tokens)
        ):
            return False
        meta = metas[0]
        if not meta.prefills:
            return all(m.num_decodes == hidden.shape[0] for m in metas)
        quantized = self.kv_scales is not None
        return self.step.runs_chunks and all(
            len(m.prefills) == len(meta.prefills)
            and all(self.backend.runs_prefill_kernel(p, quantized) for p in m.prefills)
            for m in metas
        )

    def __call__(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metas: list,
        lora=None,
        count_experts: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`metas`: as `applies`'; `lora`: the step's `LoRABatch` when some of its tokens run an adapter;
        `count_experts`: add the step's tokens to the MoE layers' expert counters (`counts_experts()`)."""
        return tuple(self.step.run(*self.run_args(positions, hidden, residual, metas, lora, count_experts)))

    def run_args(self, positions, hidden, residual, metas, lora=None, count_experts=True) -> tuple:
        """The C++ step's arguments for this step (`DecodeStep.run`'s, in order)."""
        segments = [] if lora is None else [lora.segments.starts, lora.segments.slots, lora.segments.scales]
        meta = metas[0]
        decodes = meta.num_decodes > 0

        def decode_inputs(m):  # a group's slots, and its decodes' block tables and context lengths
            if not decodes:
                return m.slot_mapping, _NONE, _NONE
            return m.slot_mapping, m.decode_block_tables, m.decode_context_lens

        return (
            hidden,
            residual,
            positions,
            *decode_inputs(meta),
            self.rotaries[0].table(hidden),
            segments,
            [v for p in meta.prefills for v in (p.start, p.end, p.cached)],
            [p.block_table for p in meta.prefills],
            [t for m in metas[1:] for t in decode_inputs(m)],
            [p.block_table for m in metas[1:] for p in m.prefills],
            [r.table(hidden) for r in self.rotaries[1:]],
            count_experts,
        )
