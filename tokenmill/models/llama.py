"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): only the math.

The forward pass takes a flat batch of tokens from many sequences (`input_ids`, `positions`, and the
attention metadata that says which tokens belong to which sequence); nothing is padded in the linear
layers, so prefill chunks and decode tokens share one pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, SwiGLU


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = rotary
        self.backend: AttentionBackend | None = None  # bound by the model runner with the KV cache
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = self.rotary(positions, qkv[:, : self.num_heads + self.num_kv_heads])  # one rotation for q and k
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint names that we fuse: (our fused parameter, shard index) by checkpoint module name
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    fused_modules = ("qkv_proj", "gate_up_proj")

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] for the whole flat batch. Returns final hidden states [T, hidden]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        return [c.intermediate_size] * 2

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor `name` (HF naming) goes: (our parameter name, shard index within a
        fused parameter or None), or None for tensors we do not keep (rotary caches, a tied lm_head)."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        parts = name.split(".")
        fused = self.packed_modules.get(parts[-2]) if len(parts) >= 2 else None
        if fused:
            return ".".join(parts[:-2] + [fused[0], parts[-1]]), fused[1]
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names, e.g. `model.layers.0.self_attn.q_proj.weight`) into
        our parameters, fusing q/k/v and gate/up. Raises if a tensor is unknown, misshapen or missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.checkpoint_target(name)
            if target is None:
                continue
            pname, shard = target
            param = _param(params, pname, name)
            if shard is not None:
                sizes = self.shard_sizes(pname.split(".")[-2])
                dest = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                loaded.add(f"{pname}#{shard}")
            else:
                dest = param.data
                loaded.add(pname)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
        missing = []
        for pname in params:
            module = pname.split(".")[-2] if "." in pname else ""
            if module in self.fused_modules:
                shards = len(self.shard_sizes(module))
                missing += [f"{pname}#{i}" for i in range(shards) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:4])}")


def _param(params: dict[str, nn.Parameter], pname: str, ckpt_name: str) -> nn.Parameter:
    if pname not in params:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to this model")
    return params[pname]

