"""DFlash drafter (block diffusion drafting, z-lab 2026), read from the published checkpoint layout
(`DFlashDraftModel`, z-lab/dflash and the drafters on the Hub): config.json is a Qwen3 config of the
drafter's layers (`num_hidden_layers`, heads, `head_dim`, `rope_theta` or `rope_parameters`, every
`layer_types` entry `full_attention`) plus `block_size` and `mask_token_id` and `target_layer_ids`
(each top-level or in `dflash_config`); optional `dflash_config.input_embedding_scale`,
`output_multiplier` and `final_logit_softcapping`. Tensors: `fc.weight` [H, n * H] (the n target
layers' hidden states fused), `hidden_norm.weight`, per layer `layers.{i}.input_layernorm`,
`post_attention_layernorm`, `self_attn.{q,k,v,o}_proj` (biases with `attention_bias`),
`self_attn.{q,k}_norm` (per head, Qwen3's), `mlp.{gate,up,down}_proj`, and `norm.weight`. There is no
embedding and no LM head: the target's are shared. DFlash2 checkpoints (convolutions, a candidate
selector) are refused.

How it drafts. The target keeps the output of each layer in `target_layer_ids` (HF's
`hidden_states[i + 1]`: the residual stream entering layer i + 1, `LlamaModel.aux_layers`). The context
of position t is `hidden_norm(fc(those [t]))`; each drafter layer turns it, through its own k/v
projections (no input norm), into that position's key and value — so a position's K/V depend only on
the target, never on earlier drafts, and are computed once (`BlockDrafter` caches them). To draft
after the newest token x at position p, the drafter runs one block [x, mask, ..., mask] at positions
p .. p + k: its queries attend, non-causally, to the context of positions < p and to the whole block;
rows 1 .. k, through the target's LM head, are the k drafts — all in one forward pass.

`DFlashModule` is plain torch (differentiable: the trainer trains this very module, `train_dflash`),
under the published tensor names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.rotary import rope_inverse_frequencies

FIELD = "speculative_config.model"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURE = "DFlashDraftModel"
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: keys, values [T, kv_heads, head_dim]


@dataclasses.dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> DFlashConfig:
        """From config.json's contents; errors name the field and `where`."""
        if raw.get("architectures") and raw["architectures"][0] != ARCHITECTURE:
            raise ValueError(f"{FIELD}: {where}: architecture {raw['architectures'][0]} is not {ARCHITECTURE}")
        extra = raw.get("dflash_config") or {}

        def value(name, default=None):
            return extra.get(name, raw.get(name, default))

        def positive(name, default=None):
            v = value(name, default)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{FIELD}: {where} field {name} must be a positive integer, got {v!r}")
            return v

        types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in types) or raw.get("is_causal"):
            raise ValueError(f"{FIELD}: {where} field layer_types: only non-causal full_attention layers are read")
        layers = value("target_layer_ids")
        if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise ValueError(f"{FIELD}: {where} field target_layer_ids must list target layers, got {layers!r}")
        mask = value("mask_token_id")
        if not isinstance(mask, int) or mask < 0:
            raise ValueError(f"{FIELD}: {where} field mask_token_id must be a token id, got {mask!r}")
        rope = raw.get("rope_parameters") or {}
        heads = positive("num_attention_heads")
        return cls(
            hidden_size=positive("hidden_size"),
            num_hidden_layers=positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=positive("num_key_value_heads", heads),
            head_dim=positive("head_dim", raw.get("hidden_size", 0) // heads),
            intermediate_size=positive("intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=raw.get("rope_scaling")
            or ({**rope} if rope.get("rope_type", "default") != "default" else None),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=positive("block_size", 16),
            mask_token_id=mask,
            target_layer_ids=layers,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=value("final_logit_softcapping"),
        )

    def to_dict(self) -> dict:
        """config.json of the published layout."""
        c = self
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling,
            "attention_bias": c.attention_bias,
            "layer_types": ["full_attention"] * c.num_hidden_layers,
            "tie_word_embeddings": False,
            "block_size": c.block_size,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids},
            "torch_dtype": "float32",
        }


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        h, d, bias = c.hidden_size, c.head_dim, c.attention_bias
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        attn = self.self_attn = nn.Module()
        attn.q_proj = _linear(h, c.num_attention_heads * d, bias)
        attn.k_proj = _linear(h, c.num_key_value_heads * d, bias)
        attn.v_proj = _linear(h, c.num_key_value_heads * d, bias)
        attn.o_proj = _linear(c.num_attention_heads * d, h, bias)
        attn.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        attn.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        mlp = self.mlp = nn.Module()
        mlp.gate_proj = _linear(h, c.intermediate_size)
        mlp.up_proj = _linear(h, c.intermediate_size)
        mlp.down_proj = _linear(c.intermediate_size, h)

    def key_value(self, x: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> rotated, normed keys and values [T, kv_heads, head_dim]."""
        attn, d = self.self_attn, self.self_attn.k_norm.normalized_shape[0]
        k = rotate(attn.k_norm(attn.k_proj(x).unflatten(-1, (-1, d))))
        return k, attn.v_proj(x).unflatten(-1, (-1, d))


class DFlashModule(nn.Module):
    ignored_tensors = ("spark_head.", "confidence_head.")  # a DSpark checkpoint's heads, read as DFlash

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = _linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # float32 whatever the module's dtype (not a buffer: `.to(dtype)` leaves it alone)
        self.inv_freq = rope_inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

    @classmethod
    def from_raw(cls, config: DFlashConfig, raw: dict, where: str) -> DFlashModule:
        """The module a checkpoint's config.json describes (a subclass reads its own fields of `raw`)."""
        return cls(config)

    def rotary(self, positions: torch.Tensor):
        """The rotation (HF's rotate-half) at `positions` [T], for x [T, heads, head_dim]."""
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)
        cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
            return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

        return rotate

    def context(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> LayerKV:
        """The target's hidden states [T, n * H] at `positions` -> each layer's keys and values there."""
        ctx, rotate = self.hidden_norm(self.fc(target_hidden)), self.rotary(positions)
        return [layer.key_value(ctx, rotate) for layer in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[LayerKV],
        sizes: list[int],
        masks: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Blocks of query rows: `embeds` [N, H] at `positions` [N], split into groups of `sizes`; group g
        attends to its context `contexts[g]` and to its own rows (with `masks[g]` [rows, context +
        rows]: True where a row may look; None: everywhere). Returns the final-normed hidden [N, H]."""
        rotate, h = self.rotary(positions), embeds
        c = self.config
        for i, layer in enumerate(self.layers):
            attn, x = layer.self_attn, layer.input_layernorm(h)
            q = rotate(attn.q_norm(attn.q_proj(x).unflatten(-1, (-1, c.head_dim))))
            k, v = layer.key_value(x, rotate)
            outs, first = [], 0
            for g, size in enumerate(sizes):
                ck, cv = contexts[g][i]
                keys = torch.cat((ck, k[first : first + size])).transpose(0, 1)[None]
                values = torch.cat((cv, v[first : first + size])).transpose(0, 1)[None]
                mask = masks[g] if masks is not None else None
                out = F.scaled_dot_product_attention(
                    q[first : first + size].transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
                )
                outs.append(out[0].transpose(0, 1).flatten(1))
                first += size
            h = h + attn.o_proj(torch.cat(outs))
            x = layer.post_attention_layernorm(h)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
        return self.norm(h)

    def layout(self) -> dict:
        """config.json of the published layout."""
        return self.config.to_dict()

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target LM head's logits as the drafter's config shapes them."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def propose(self, hidden: torch.Tensor, rows: list[range], newest: list[int], step) -> list[list[int]]:
        """Each request's drafts: the argmax of its block rows `rows[r]` of `hidden` through the target's
        LM head (`step`: a `block_drafter.BlockStep`)."""
        flat = [i for r in rows for i in r]
        tokens = self.scale_logits(step.logits(hidden[flat])).argmax(-1).tolist()
        out, first = [], 0
        for r in rows:
            out.append(tokens[first : first + len(r)])
            first += len(r)
        return out


def read_checkpoint(path: str, what: str = "DFlash") -> tuple[dict, dict[str, torch.Tensor], Path]:
    """(config.json contents, tensors, directory) of a drafter checkpoint directory."""
    from tokenmill.spec_decode.medusa import read_tensors

    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{FIELD}: {root} has no config.json (a {what} checkpoint directory)")
    return json.loads(config_file.read_text()), read_tensors(root, WEIGHT_FILES, what), root


def load_state(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor of `module` from `tensors` by name and shape, none missing, none left over."""
    want = module.state_dict()
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(
            f"{FIELD}: {where}: "
            + "; ".join(
                f"{label} {', '.join(names[:4])}"
                for label, names in (("lacks", missing), ("has unexpected tensors", unexpected))
                if names
            )
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            raise ValueError(
                f"{FIELD}: {where}: {name} has shape {tuple(tensor.shape)}, config.json says {tuple(want[name].shape)}"
            )
    module.load_state_dict({n: t.to(want[n].dtype) for n, t in tensors.items()})


def check_target(config: DFlashConfig, target, where: str) -> tuple[int, ...]:
    """The target's `aux_layers` that give the drafter's `target_layer_ids`; errors name the mismatch."""
    from tokenmill.models.llama import LlamaModel

    decoder, tc = target.model.model, target.config
    if not isinstance(decoder, LlamaModel) or type(decoder).forward is not LlamaModel.forward:
        raise ValueError(f"speculative_config.method dflash needs a Llama-family target, not {tc.architecture}")
    if config.hidden_size != tc.hidden_size:
        raise ValueError(
            f"{FIELD}: {where} field hidden_size is {config.hidden_size}, the target's is {tc.hidden_size} "
            "(a DFlash drafter shares the target's embedding and LM head)"
        )
    ids = config.target_layer_ids
    if list(ids) != sorted(set(ids)) or ids[-1] >= tc.num_hidden_layers - 1:
        raise ValueError(
            f"{FIELD}: {where} field target_layer_ids must be increasing layers below the target's last "
            f"({tc.num_hidden_layers - 1}), got {ids}"
        )
    if config.mask_token_id >= tc.vocab_size:
        raise ValueError(
            f"{FIELD}: {where} field mask_token_id {config.mask_token_id} is outside the target's vocabulary"
        )
    return tuple(i + 1 for i in ids)


def load_dflash(path: str, target, module_class: type[DFlashModule] | None = None) -> DFlashModule:
    """The drafter in checkpoint directory `path` for `target` (a LoadedModel), whose forward is set to
    keep the hidden states the drafter reads (`aux_hidden`)."""
    raw, tensors, root = read_checkpoint(path)
    where = str(root / "config.json")
    if any(n.startswith("candidate_selector.") or "_conv." in n for n in tensors):
        raise ValueError(f"{FIELD}: {root} is a DFlash2 checkpoint (convolutions, candidate selector): not supported")
    config = DFlashConfig.from_dict(raw, where)
    aux = check_target(config, target, where)
    module = (module_class or DFlashModule).from_raw(config, raw, where)
    kept = {n: t for n, t in tensors.items() if not n.startswith(module.ignored_tensors)}
    load_state(module, kept, str(root))
    module = module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    target.model.model.aux_layers = aux
    return module


def save_dflash(module: DFlashModule, path: str, extra: dict | None = None) -> None:
    """Write a drafter in the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in module.state_dict().items()}, str(root / "model.safetensors"))
    config = {**module.layout(), **(extra or {})}
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
