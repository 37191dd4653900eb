"""A model's facts for planning, without its weights: parameters by kind (what a decode step reads and
what each weight format would store) and each attention layer's KV row.

The facts come from the engine's own model built on the meta device (shapes only, no memory), as
`tokenmill info` does, so every architecture's layout (fused experts, MLA, window layers) is the one
the engine runs. The bytes formulas here are torch-free and checked against the engine's
`AttentionSpec.bytes_per_token` in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# bits a weight of each format's linear layers, scales included (README, "Models and weight formats"):
# int8 codes with a float16 scale per 32 columns; int4 codes with a float16 scale and minimum per 32;
# fp8 bytes (its float32 scale per row is negligible); NVFP4 nibbles + an e4m3 scale per 16; MXFP4
# nibbles + an E8M0 scale per 32
WEIGHT_BITS = {"float32": 32.0, "float16": 16.0, "fp8": 8.0, "int8": 8.5, "int4": 5.0, "nvfp4": 4.5, "mxfp4": 4.25}
# the LM head under int4 keeps 8 bits (tokenmill.quantization.int_quant), as llama.cpp's Q4 files do
HEAD_BITS = {**WEIGHT_BITS, "int4": WEIGHT_BITS["int8"]}
# bytes a stored K/V value; int8 / fp8 rows also carry a bfloat16 scale (tokenmill.attention.kv_quant)
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
KV_SCALE_BYTES = 2


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's cache row per token: `tensors` (2: K and V; 1: MLA's latent row) of
    `kv_heads` x `head_dim` values; `window`: a sliding window bounds what it keeps. `query_heads` and
    `value_dim` size the attention FLOPs per cached token."""

    kv_heads: int
    head_dim: int
    window: int | None
    tensors: int
    query_heads: int
    value_dim: int

    def bytes_per_token(self, kv_dtype: str) -> int:
        scale = KV_SCALE_BYTES if kv_dtype in ("int8", "fp8") else 0
        return self.tensors * self.kv_heads * (self.head_dim * KV_DTYPE_BYTES[kv_dtype] + scale)

    def attention_flops(self, context: int) -> int:
        """FLOPs of one query token over `context` cached ones: q.k and p.v per head."""
        held = context if self.window is None else min(context, self.window)
        return 2 * self.query_heads * (self.head_dim + self.value_dim) * held


@dataclass
class ModelFacts:
    """Parameter counts by kind: `linear` (every projection outside routed experts), `experts` (all
    routed experts' weights), `head` (the LM head; with tied embeddings the same matrix as
    `embedding`, still read every step), `embedding` (a row per token is read: not per step), `other`
    (norms, biases)."""

    name: str
    architecture: str
    linear: int
    experts: int
    head: int
    embedding: int
    other: int
    tied: bool
    num_experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    layers: list[LayerKV]
    max_context: int
    file_format: str | None = None  # the checkpoint's own: "gguf Q4_K_M", "bfloat16"
    file_bytes: int | None = None  # what its weight tensors take
    file_read_bytes: int | None = None  # of those, what a batch-1 decode step reads
    file_expert_bytes: int = 0  # of those, the routed experts'
    notes: list[str] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return self.linear + self.experts + self.embedding + self.other + (0 if self.tied else self.head)

    @property
    def active_matmul_params(self) -> float:
        """Weights one token multiplies (2 FLOPs each): the projections, its top-k experts, the head."""
        return self.linear + self.head + self.experts * self.expert_fraction(1)

    @property
    def active_params(self) -> float:
        return self.total_params - self.experts * (1 - self.expert_fraction(1))

    def expert_fraction(self, batch: int) -> float:
        """Share of each layer's routed experts a decode step of `batch` tokens touches, routing taken
        as uniform and independent: 1 - (1 - k/E)^batch (k/E at batch 1, near 1 once batch >> E/k)."""
        if not self.num_experts:
            return 0.0
        return 1 - (1 - self.experts_per_token / self.num_experts) ** batch

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Every layer's row for one token (window layers counted too: the cost while inside the window)."""
        return sum(layer.bytes_per_token(kv_dtype) for layer in self.layers)

    def kv_bytes_per_sequence(self, context: int, kv_dtype: str) -> int:
        """A sequence of `context` tokens: window layers hold at most their window."""
        return sum(
            layer.bytes_per_token(kv_dtype) * (context if layer.window is None else min(context, layer.window))
            for layer in self.layers
        )

    def decode_step_bytes(self, fmt: str, batch: float, context: int, kv_dtype: str, tokens: int) -> float:
        """What a decode step of `batch` sequences at `context` tokens reads in weight format `fmt`: the
        weights once, the share of the routed experts its `tokens` tokens touch, each sequence's KV."""
        _held, read, experts = self.weight_bytes(fmt)
        return read + experts * self.expert_fraction(tokens) + batch * self.kv_bytes_per_sequence(context, kv_dtype)

    def attention_flops(self, context: int) -> int:
        return sum(layer.attention_flops(context) for layer in self.layers)

    def flops_per_token(self, context: int, prefill: bool = False) -> float:
        """One token's FLOPs: its matmuls and attention over `context` cached tokens, or, in a prefill of
        `context` tokens, over the causal half of them on average (the roofline's and the measured share's)."""
        attention = self.attention_flops(context)
        return 2 * self.active_matmul_params + (attention / 2 if prefill else attention)

    def weight_bytes(self, fmt: str) -> tuple[float, float, float]:
        """(bytes held, bytes a batch-1 decode step reads apart from experts, all routed experts' bytes)
        in weight format `fmt`: projections and experts at its bits a weight, the head at HEAD_BITS,
        embeddings and norms in 16 bits (float32 for float32). A tied head in a quantized format is a
        second, quantized copy of the embedding."""
        if fmt == "file":
            return float(self.file_bytes), float(self.file_read_bytes), float(self.file_expert_bytes)
        bits, head_bits = WEIGHT_BITS[fmt], HEAD_BITS[fmt]
        plain = 32 if fmt == "float32" else 16
        experts = self.experts * bits / 8
        head = self.head * head_bits / 8
        shared_head = self.tied and head_bits == plain
        plain_params = self.other + (0 if shared_head else self.embedding)
        held = self.linear * bits / 8 + experts + head + plain_params * plain / 8
        read = self.linear * bits / 8 + head + self.other * plain / 8
        return held, read, experts


def model_facts(model: str | None) -> ModelFacts:
    """The facts of `model` (alias, .gguf file or HF directory): its config and, for the checkpoint's
    own format, its tensors' sizes (a GGUF header or the safetensors files' sizes). No weights are read."""
    from tokenmill.loader import open_checkpoint
    from tokenmill.loader.source import resolve_model

    source = resolve_model(model)
    ckpt = open_checkpoint(source)
    facts = facts_from_config(ckpt.config, source.name)
    if source.kind == "gguf":
        _add_gguf_sizes(facts, ckpt.reader.tensors, ckpt.reader.fields.get("general.file_type"))
    else:
        _add_safetensors_sizes(facts, ckpt.files, ckpt.config.torch_dtype, getattr(ckpt, "quant_method", None))
    return facts


def facts_from_config(config, name: str) -> ModelFacts:
    """Facts from a `tokenmill.config.ModelConfig`: the model built on the meta device, its parameters
    sorted by kind, its attention layers' KV rows."""
    import torch

    from tokenmill.layers.attention import Attention
    from tokenmill.layers.fused_moe import FusedMoE
    from tokenmill.loader import build_model
    from tokenmill.quantization.unquantized import UnquantizedConfig

    net = build_model(config, UnquantizedConfig(), torch.float32, torch.device("meta"))
    moe = [m for m in net.modules() if isinstance(m, FusedMoE)]
    expert_ids = {id(p) for m in moe for p in (m.w13, m.w2)}
    counts = dict(linear=0, experts=0, head=0, embedding=0, other=0)
    for pname, p in net.named_parameters():  # shared (tied) tensors are listed once
        kind = (
            "experts"
            if id(p) in expert_ids
            else "embedding"
            if "embed_tokens" in pname
            else "head"
            if pname.startswith("lm_head")
            else "linear"
            if p.dim() >= 2
            else "other"
        )
        counts[kind] += p.numel()
    tied = config.tie_word_embeddings
    if tied:
        counts["head"] = counts["embedding"]
    layers = []
    for m in net.modules():
        if isinstance(m, Attention):
            spec = m.kv_spec(torch.float32)
            mla = m.latent_rope_dim is not None
            layers.append(
                LayerKV(
                    spec.num_kv_heads,
                    spec.head_dim,
                    spec.sliding_window,
                    spec.num_tensors,
                    m.num_heads,
                    spec.head_dim - m.latent_rope_dim if mla else spec.head_dim,
                )
            )
    return ModelFacts(
        name,
        config.architecture,
        tied=tied,
        num_experts=moe[0].num_experts if moe else 0,
        experts_per_token=moe[0].top_k if moe else 0,
        layers=layers,
        max_context=config.max_position_embeddings,
        **counts,
    )


def _add_gguf_sizes(facts: ModelFacts, tensors, file_type: int | None) -> None:
    """The file's own blocks: every tensor's bytes; a step reads all but the embedding table (unless
    it is also the head) and the unused experts. Named by the file's `general.file_type` (a mix such as
    Q4_K_M), else by the tensor type holding most bytes."""
    from gguf import LlamaFileType

    held = read = experts = 0
    types: dict[str, int] = {}
    for t in tensors:
        size = t.data.nbytes
        held += size
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + size
        if "_exps." in t.name:
            experts += size
        elif t.name != "token_embd.weight" or facts.tied:
            read += size
    try:
        name = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        name = max(types, key=types.get)
    facts.file_format = f"gguf {name}"
    facts.file_bytes, facts.file_read_bytes, facts.file_expert_bytes = held, read, experts


def _add_safetensors_sizes(facts: ModelFacts, files, torch_dtype: str | None, quant_method: str | None) -> None:
    """An HF directory: the files' sizes; what a step reads in the same share as the float16 layout's."""
    held = sum(f.stat().st_size for f in files)
    f16_held, f16_read, f16_experts = facts.weight_bytes("float16")
    facts.file_format = quant_method or torch_dtype or "safetensors"
    facts.file_bytes = held
    facts.file_read_bytes = int(held * f16_read / f16_held)
    facts.file_expert_bytes = int(held * f16_experts / f16_held)
