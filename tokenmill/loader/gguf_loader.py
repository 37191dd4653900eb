"""Read a GGUF file: model config from its metadata (translated to config.json fields), tensors
renamed to HF names, each either dequantized or handed over as its packed blocks
(`GGUFWeight.blocks`, for the `gguf` quantization method)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.config import ModelConfig
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.models.registry import GGUF_ARCHITECTURES, config_from_hf_dict
from tokenmill.quantization.gguf_codes import Codes, unpack

_DEQUANTIZABLE = {
    GGMLQuantizationType[t]
    for t in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router, and every expert stacked in one tensor
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's norms around each block, and the norm-weight shift llama.cpp's converter applies (it stores 1 + w)
_GEMMA_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("gemma2", "gemma3")
_PHI3_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # stored fused
# DeepSeek's latent attention (kv_b split by newer converters into k_b, transposed, and v_b), shared experts
_DEEPSEEK_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_GATING = {1: "softmax", 2: "sigmoid"}  # expert_gating_func; files without it are DeepSeek-V2 (softmax)
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 longrope, read as config
# llama.cpp's default for renormalising the top-k routing weights, where the file does not say
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass
class GGUFWeight:
    """One tensor as stored in the file: `qtype` and the packed `raw` bytes, plus how to undo
    llama.cpp's q/k row permutation. `dequantize()` gives the float tensor in HF layout."""

    name: str
    qtype: GGMLQuantizationType
    raw: np.ndarray
    unpermute_heads: int | None = None
    shape: tuple[int, ...] | None = None  # the HF shape where it differs from the file's (a [H] gate row)
    offset: float = 0.0  # added to every value (Gemma norms: the file stores 1 + w)
    values: torch.Tensor | None = None  # a float tensor stored in HF layout: a view of the file's map

    def dequantize(self) -> torch.Tensor:
        values = np.asarray(dequantize(self.raw, self.qtype), dtype=np.float32)
        if self.shape is not None:
            values = values.reshape(self.shape)
        if self.offset:
            values = values + np.float32(self.offset)
        if self.unpermute_heads:
            values = _unpermute(values, self.unpermute_heads)
        if not values.flags.writeable or not values.flags.c_contiguous:  # F32 tensors are views of the mmap
            values = values.copy()
        return torch.from_numpy(values)

    def stored(self) -> torch.Tensor:
        """The tensor in the float dtype it is stored in, without a copy where the file holds it in HF
        layout (a view of the file's map), else dequantized."""
        return self.values if self.values is not None else self.dequantize()

    def expert(self, e: int) -> GGUFWeight:
        """Expert `e`'s matrix of a tensor stacking every expert of a layer ([E, rows, bytes])."""
        return GGUFWeight(f"{self.name}[{e}]", self.qtype, self.raw[e])

    def codes(self) -> Codes:
        """A quantized tensor's integer codes and per-block scales and offsets, rows in HF order."""
        c = unpack(self.qtype.name, self.raw, self.raw.shape[0])
        if not self.unpermute_heads:
            return c
        fix = lambda a: None if a is None else np.ascontiguousarray(_unpermute(a, self.unpermute_heads))  # noqa: E731
        return replace(c, q=fix(c.q), scales=fix(c.scales), offsets=fix(c.offsets), supers=fix(c.supers))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its RoPE; put them back in HF's rotate-half order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFFile(path)
        except (ValueError, OSError) as e:  # a damaged or truncated file, or an empty one (mmap)
            raise ValueError(f"cannot read GGUF file {path}: {e}") from None
        self.config = self._read_config()

    def _field(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def _read_config(self) -> ModelConfig:
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        p = lambda key, default=None: self._field(f"{arch}.{key}", default)  # noqa: E731
        heads = p("attention.head_count")
        hidden = p("embedding_length")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = p("vocab_size") or (len(tokens) if tokens else None)
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ValueError(f"{self.path.name}: GGUF rope frequency factors (rope_freqs) are not supported yet")
        scaling = None
        if p("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": p("rope.scaling.factor")}
        elif p("rope.scaling.type") == "yarn":
            scaling = {
                "rope_type": "yarn",
                "factor": float(p("rope.scaling.factor")),
                "original_max_position_embeddings": int(p("rope.scaling.original_context_length")),
            }
            if p("rope.scaling.yarn_log_multiplier") is not None:  # DeepSeek: llama.cpp writes 0.1 * mscale_all_dim
                mscale = float(p("rope.scaling.yarn_log_multiplier")) / 0.1
                scaling.update(mscale=mscale, mscale_all_dim=mscale)
        if _ROPE_FACTORS[0] in names:
            factors = {
                t.name: [float(x) for x in np.asarray(t.data).reshape(-1)]
                for t in self.reader.tensors
                if t.name in _ROPE_FACTORS
            }
            scaling = {
                "rope_type": "longrope",
                "long_factor": factors[_ROPE_FACTORS[0]],
                "short_factor": factors[_ROPE_FACTORS[1]],
                "original_max_position_embeddings": int(p("rope.scaling.original_context_length")),
            }
            if p("rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(p("rope.scaling.attn_factor"))
        experts = int(p("expert_count", 0))
        hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch]
        moe = (
            {}
            if not experts
            else {
                "num_experts": experts,
                "num_experts_per_tok": int(p("expert_used_count")),
                "moe_intermediate_size": int(p("expert_feed_forward_length", p("feed_forward_length"))),
                "norm_topk_prob": bool(p("expert_weights_norm", _NORM_TOPK.get(arch, True))),
                "shared_expert_intermediate_size": int(p("expert_shared_feed_forward_length", 0)),
            }
        )
        gemma = (
            {}
            if arch not in _GEMMA
            else {
                "attn_logit_softcapping": p("attn_logit_softcapping"),
                "final_logit_softcapping": p("final_logit_softcapping"),
                "query_pre_attn_scalar": int(p("attention.key_length", hidden // heads)),  # as llama.cpp (not 27B)
            }
        )
        head_dim = int(p("attention.key_length", hidden // heads))
        deepseek = {} if arch != "deepseek2" else self._deepseek_fields(p)
        if deepseek.get("scoring_func") == "sigmoid":
            hf_arch = "DeepseekV3ForCausalLM"
        return config_from_hf_dict(
            {  # the config.json this file's metadata stands for
                "architectures": [hf_arch],
                **moe,
                **gemma,
                **deepseek,
                "sliding_window": p("attention.sliding_window"),
                "partial_rotary_factor": int(p("rope.dimension_count", head_dim)) / head_dim,
                "vocab_size": int(vocab),
                "hidden_size": int(hidden),
                "intermediate_size": int(p("feed_forward_length", 0) or p("expert_feed_forward_length")),
                "num_hidden_layers": int(p("block_count")),
                "num_attention_heads": int(heads),
                "num_key_value_heads": int(p("attention.head_count_kv", heads)),
                "head_dim": head_dim,
                "rms_norm_eps": float(p("attention.layer_norm_rms_epsilon", 1e-6)),
                "rope_theta": float(p("rope.freq_base", 10000.0)),
                "rope_scaling": scaling,
                "max_position_embeddings": int(p("context_length", 2048)),
                "tie_word_embeddings": "output.weight" not in names,
                "attention_bias": "blk.0.attn_q.bias" in names,
            }
        )

    @staticmethod
    def _deepseek_fields(p) -> dict:
        """DeepSeek-V2/V3 config.json fields. Files written for llama.cpp's MLA path give the latent
        sizes as key/value length and the per-head ones as key_length_mla / value_length_mla."""
        rope = int(p("rope.dimension_count"))
        mla = p("attention.key_length_mla") is not None
        key = int(p("attention.key_length_mla" if mla else "attention.key_length"))
        groups = int(p("expert_group_count", 1))
        return {
            "q_lora_rank": p("attention.q_lora_rank"),
            "kv_lora_rank": int(p("attention.kv_lora_rank")),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": key - rope,
            "v_head_dim": int(p("attention.value_length_mla" if mla else "attention.value_length")),
            "n_routed_experts": int(p("expert_count", 0)),
            "num_experts_per_tok": int(p("expert_used_count", 0)),
            "moe_intermediate_size": int(p("expert_feed_forward_length", 0)),
            "n_shared_experts": int(p("expert_shared_count", 0)),
            "first_k_dense_replace": int(p("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(p("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(p("expert_weights_norm", False)),
            "scoring_func": _GATING.get(int(p("expert_gating_func", 1)), "softmax"),
            "n_group": groups,
            "topk_group": int(p("expert_group_used_count", 1)),
            "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        }

    def tensor_types(self) -> dict[str, str]:
        """GGUF type name of every tensor, by HF name."""
        return {name: w.qtype.name for name, w in self.weights()}

    def weights(self) -> Iterator[tuple[str, GGUFWeight]]:
        """Tensors under HF names, lazily: nothing is dequantized until asked."""
        arch = self._field("general.architecture")
        permute, gemma = arch in ("llama", "mistral"), arch in _GEMMA
        own = {"phi3": _PHI3_LAYER_NAMES, "deepseek2": _DEEPSEEK_LAYER_NAMES, **{g: _GEMMA_LAYER_NAMES for g in _GEMMA}}
        names = {**_LAYER_NAMES, **own.get(arch, {})}
        c = self.config
        for t in self.reader.tensors:
            if t.tensor_type not in _DEQUANTIZABLE:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not supported "
                    f"(supported: {', '.join(sorted(q.name for q in _DEQUANTIZABLE))})"
                )
            if t.name in _ROPE_FACTORS:
                continue
            name, heads, shape = _GLOBAL_NAMES.get(t.name), None, None
            if name is None:
                m = _LAYER_RE.match(t.name)
                if not m or not {m.group(2), f"{m.group(2)}.{m.group(3)}"} & names.keys():
                    raise ValueError(f"{self.path.name}: unexpected tensor {t.name!r} for a {arch} model")
                layer, part, kind = m.groups()
                whole = names.get(f"{part}.{kind}")  # a tensor renamed as a whole (DeepSeek's router bias)
                name = f"model.layers.{layer}.{whole or names[part] + '.' + kind}"
                if part == "ffn_gate_inp_shexp":
                    shape = (1, c.hidden_size)
                if permute and part == "attn_q":
                    heads = c.num_attention_heads
                elif permute and part == "attn_k":
                    heads = c.num_key_value_heads
            offset = -1.0 if gemma and name.endswith("norm.weight") else 0.0
            as_is = heads is None and shape is None and not offset
            values = self.reader.values(t) if as_is else None
            yield name, GGUFWeight(t.name, t.tensor_type, t.data, heads, shape, offset, values)
