"""Quantized linear layers for CPU decoding.

- `gguf` (the default for GGUF files on CPU): each linear layer keeps the file's own Q4_0 / Q4_1 /
  Q8_0 blocks (`BlockQuantLinear`); the matmul dequantizes inside the kernel, so it computes on the
  same float32 weights as the dequantized checkpoint while reading 4-7x fewer bytes.
- `int8` (opt-in): every linear weight becomes int8 with one float scale per output row (symmetric,
  absmax); the matmul is torch's packed `_weight_int8pack_mm` on bfloat16 activations. Outputs are
  no longer bit-identical to the float32 reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from tokenmill.kernels import block_quant

QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8")
# batches up to this many tokens run the fused kernel; larger ones dequantize once and use torch's GEMM
FUSED_MAX_TOKENS = 16


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str, device: torch.device) -> None:
    """Replace the model's linear layers (projections, MLP and the output head) with int8 ones, in place."""
    if method != "int8":
        raise ValueError(f"quantize_model only does 'int8', got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} uses a CPU kernel; it is not available on {device.type}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))


class BlockQuantLinear(nn.Module):
    """A linear layer on GGUF blocks of 32 (see `tokenmill.kernels.block_quant` for the layout)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
                 bias: bool) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        self.bits = bits
        self.out_features, self.in_features = scales.shape[0], scales.shape[1] * block_quant.BLOCK
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] <= FUSED_MAX_TOKENS:
            out = block_quant.matmul(flat, self.codes, self.scales, self.offsets, self.bits)
        else:
            weight = block_quant.dequantize(self.codes, self.scales, self.offsets, self.bits,
                                            out=block_quant.workspace(self.out_features, self.in_features))
            out = flat @ weight.t()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return block_quant.dequantize(self.codes, self.scales, self.offsets, self.bits)


def gguf_blocks(qtype_name: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Split a GGUF Q4_0 / Q4_1 / Q8_0 tensor into (codes, scales, offsets, bits), one row per output."""
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[qtype_name])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if qtype_name == "Q4_1":
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 4:]
    else:
        m = -8 * d if qtype_name == "Q4_0" else None  # Q4_0: d * (q - 8) == d * q + (-8 d), exactly
        codes = blocks[..., 2:]
    bits = 8 if qtype_name == "Q8_0" else 4
    return np.ascontiguousarray(codes).reshape(rows, -1), d, m, bits


BLOCK_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def install_block_quant_layers(model: nn.Module, weights: Iterable[tuple[str, object]]) -> set[str]:
    """Replace each linear layer whose checkpoint tensors are all Q4_0/Q4_1/Q8_0 with a
    `BlockQuantLinear` built from those blocks. `weights` yields (HF name, GGUFWeight). Returns the
    checkpoint names consumed (the dense loader skips them); biases are still loaded densely."""
    modules = dict(model.named_modules())
    shards: dict[str, dict[int, tuple[str, tuple]]] = {}
    for name, w in weights:
        if not name.endswith(".weight") or w.qtype.name not in BLOCK_QUANT_TYPES:
            continue
        target = model.checkpoint_target(name)
        if name == "model.embed_tokens.weight" and model.config.tie_word_embeddings:
            target = ("lm_head.weight", None)  # the tied output head reads the embedding's blocks
        if target is None:
            continue
        module_name = target[0].rsplit(".", 1)[0]
        if isinstance(modules.get(module_name), nn.Linear):
            shards.setdefault(module_name, {})[target[1] or 0] = (name, w.blocks())
    consumed = set()
    for module_name, parts in shards.items():
        linear = modules[module_name]
        attr = module_name.rsplit(".", 1)[-1]
        expected = len(model.shard_sizes(attr)) if attr in model.fused_modules else 1
        pieces = [parts.get(i) for i in range(expected)]
        if any(p is None for p in pieces) or len({p[1][3] for p in pieces}) != 1:
            continue  # some shard is another type (e.g. a K-quant): this layer stays dense
        codes, scales, offsets, bits = zip(*(p[1] for p in pieces))
        cat = lambda arrays: torch.from_numpy(np.concatenate(arrays))  # noqa: E731
        layer = BlockQuantLinear(cat(codes).view(torch.int8) if bits[0] == 8 else cat(codes), cat(scales),
                                 None if offsets[0] is None else cat(offsets), bits[0], linear.bias is not None)
        parent_name, _, attr = module_name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr, layer)
        consumed.update(p[0] for p in pieces if p[0] != "model.embed_tokens.weight")
    return consumed
