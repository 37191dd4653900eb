"""EAGLE-3 drafter (Li et al., 2025), read from the published checkpoint layout (EAGLE-3, SpecForge,
vLLM's `LlamaForCausalLMEagle3`): config.json is a Llama config of one layer plus `draft_vocab_size`,
optionally `target_hidden_size`, `norm_before_residual` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc.weight` [H, 3 * H_target], the decoder
layer `midlayer.*` (q/k/v read concat(embedding, hidden), 2H wide; `midlayer.hidden_norm`),
`norm.weight`, `lm_head.weight` over the draft vocabulary, `d2t` (target id = draft id +
d2t[draft id]), `t2d` (ignored), and optionally `embed_tokens.weight` (else the target's embedding
is shared).

The target keeps the residual stream entering three of its layers (low, middle, high: by default
2, L // 2, L - 3, as vLLM) and `fc` fuses them into one hidden state per position. The drafter at
position t reads the embedding of token t + 1 and that hidden state of position t, and predicts
token t + 2; its output (before the final norm) is fed back as the hidden state of its next
position, so k drafts take k forward passes of its one layer (`tokenmill.spec_decode.hidden_drafter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import QKVParallelLinear, ReplicatedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader import LoadedModel, default_dtype
from tokenmill.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM, LlamaMLP, LlamaModel
from tokenmill.quantization.unquantized import UnquantizedConfig
from tokenmill.spec_decode.draft_pool import dense_weights, load_drafter_weights
from tokenmill.spec_decode.medusa import read_tensors

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURE = "LlamaForCausalLMEagle3"
FIELD = "speculative_config.model"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads [norm(embedding), hidden_norm(hidden)]; the residual
    stream starts at the hidden state."""

    def __init__(
        self, config: LlamaConfig, rotary: RotaryEmbedding, quant: UnquantizedConfig, norm_before_residual: bool
    ) -> None:
        super().__init__()
        c, prefix = config, "midlayer"
        self.norm_before_residual = norm_before_residual  # the residual stream starts at hidden_norm(hidden)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c, rotary, quant, f"{prefix}.self_attn")
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.qkv_bias,
            quant,
            f"{prefix}.self_attn.qkv_proj",
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c, quant, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.hidden_norm(hidden)[0]
        x = torch.cat((self.input_layernorm(embeds)[0], normed), dim=-1)
        residual = normed if self.norm_before_residual else hidden
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x) + residual


class Eagle3Drafter(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules
    aux = True  # reads the target's auxiliary hidden states

    def __init__(
        self,
        config: LlamaConfig,
        draft_vocab_size: int,
        target_hidden_size: int,
        own_embedding: bool,
        max_positions: int,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        quant = dense_weights(self.packed_modules)
        c = config
        rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)
        if own_embedding:
            self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        self.fc = ReplicatedLinear(3 * target_hidden_size, c.hidden_size, False, quant, "fc")
        self.midlayer = Eagle3Layer(c, rotary, quant, norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = LMHead(draft_vocab_size, c.hidden_size, quant)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Each position's output before the final norm (fed back as the next position's hidden state)."""
        return self.midlayer(positions, self.embed_tokens(input_ids), hidden_states)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three layers' hidden states [T, 3 * H_target] -> the drafter's [T, H]."""
        return self.fc(target_hidden)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(x)[0])

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _field(config: dict, name: str, path: Path):
    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{FIELD}: {path / 'config.json'} field {name} must be a positive integer, got {value!r}")
    return value


def load_eagle3(path: str, target: LoadedModel) -> Eagle3Drafter:
    """The drafter in checkpoint directory `path` for `target`, whose forward is set to keep the
    drafter's auxiliary hidden states."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{FIELD}: {root} has no config.json (an EAGLE-3 checkpoint directory)")
    raw = json.loads(config_file.read_text())
    decoder = target.model.model
    if not isinstance(decoder, LlamaModel) or type(decoder).forward is not LlamaModel.forward:
        raise ValueError(
            f"speculative_config.method eagle3 needs a Llama-family target, not {target.config.architecture}"
        )
    tc = target.config
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        _field(raw, name, root)
    draft_vocab = raw.get("draft_vocab_size", raw["vocab_size"])
    _field({"draft_vocab_size": draft_vocab}, "draft_vocab_size", root)
    target_hidden = raw.get("target_hidden_size", raw["hidden_size"])
    if target_hidden != tc.hidden_size:
        raise ValueError(
            f"{FIELD}: {config_file} field target_hidden_size (or hidden_size) is {target_hidden}, the "
            f"target's hidden size is {tc.hidden_size}"
        )
    if draft_vocab > tc.vocab_size or raw["vocab_size"] != tc.vocab_size:
        raise ValueError(
            f"{FIELD}: {config_file} fields vocab_size / draft_vocab_size ({raw['vocab_size']} / "
            f"{draft_vocab}) do not fit the target's vocabulary ({tc.vocab_size})"
        )
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(
        tc.num_hidden_layers
    )
    if len(set(aux)) != 3 or not all(isinstance(i, int) and 0 <= i < tc.num_hidden_layers for i in aux):
        raise ValueError(
            f"{FIELD}: {config_file} field eagle_config.eagle_aux_hidden_state_layer_ids must name 3 "
            f"different layers of the target's {tc.num_hidden_layers}, got {list(aux)}"
        )
    config = LlamaConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    tensors = read_tensors(root, WEIGHT_FILES, "EAGLE-3")
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if d2t is None and draft_vocab != tc.vocab_size:
        raise ValueError(
            f"{FIELD}: {root} has no d2t tensor, needed with a draft vocabulary "
            f"({draft_vocab}) smaller than the target's ({tc.vocab_size})"
        )
    head = tensors.get("lm_head.weight")
    if head is not None and tuple(head.shape) != (draft_vocab, config.hidden_size):
        raise ValueError(
            f"{FIELD}: {root}: lm_head.weight has shape {tuple(head.shape)}, config.json fields "
            f"draft_vocab_size and hidden_size say {(draft_vocab, config.hidden_size)}"
        )
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding and config.hidden_size != tc.hidden_size:
        raise ValueError(
            f"{FIELD}: {root} has no embed_tokens.weight and its hidden_size ({config.hidden_size}) "
            f"differs from the target's ({tc.hidden_size}): it cannot share the target's embedding"
        )
    with torch.device(target.device), default_dtype(target.dtype):
        drafter = Eagle3Drafter(
            config,
            draft_vocab,
            target_hidden,
            own_embedding,
            tc.max_position_embeddings,
            bool(raw.get("norm_before_residual", False)),
        )
    load_drafter_weights(drafter, tensors, f"{FIELD}: {root}")
    with torch.no_grad():
        if d2t is not None:
            if d2t.shape != (draft_vocab,) or int((torch.arange(draft_vocab) + d2t).max()) >= tc.vocab_size:
                raise ValueError(f"{FIELD}: {root}: d2t must hold {draft_vocab} offsets into the target's vocabulary")
            drafter.d2t.copy_(d2t)
    if not own_embedding:
        drafter.embed_tokens = decoder.embed_tokens
    decoder.aux_layers = tuple(sorted(aux))
    return drafter.eval()


def save_eagle3(state: dict[str, torch.Tensor], config: dict, path: str) -> None:
    """Write a drafter in the published layout: `state` in its tensor names (q/k/v and gate/up apart,
    `d2t`, ...), `config` the config.json contents."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in state.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE], **config}, indent=2) + "\n")
