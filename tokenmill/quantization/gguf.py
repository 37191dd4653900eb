"""`gguf` (the default for GGUF files on CPU in float32): linear layers keep the file's own Q4_0 /
Q4_1 / Q8_0 blocks of 32 values, and the matmul dequantizes inside the kernel
(`tokenmill.kernels.block_quant`), so the model computes on the same float32 weights as the
dequantized checkpoint while a decode step reads 4-7x fewer bytes.

The layer stores (the kernel's layout):
  4 bits: codes uint8 [N, K/2], in each 16-byte block byte j holds value j (low nibble) and value
          j+16 (high nibble), as in GGUF; scales and offsets float32 [N, K/32] (Q4_0 becomes
          offsets = -8 d, which is exactly its d * (q - 8));
  8 bits: codes int8 [N, K]; scales float32 [N, K/32]; no offsets.
A fused layer whose shards are stored with different bit widths (or in another type, e.g. a
K-quant) stays dense: its tensors are dequantized at load.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels import block_quant
from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

BLOCK_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# batches up to this many tokens run the fused kernel; larger ones dequantize once and use torch's GEMM
FUSED_MAX_TOKENS = 16


def gguf_blocks(qtype_name: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Split the bytes of a GGUF Q4_0 / Q4_1 / Q8_0 tensor into (codes, scales, offsets, bits), one
    row per output."""
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[qtype_name])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if qtype_name == "Q4_1":
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 4:]
    else:
        m = -8 * d if qtype_name == "Q4_0" else None  # Q4_0: d * (q - 8) == d * q + (-8 d), exactly
        codes = blocks[..., 2:]
    return np.ascontiguousarray(codes).reshape(rows, -1), d, m, _BITS[qtype_name]


class BlockQuantLinearMethod(LinearMethod):
    def __init__(self, bits: int) -> None:
        self.bits = bits

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if input_size % block_quant.BLOCK:
            raise ValueError(f"{layer.prefix}: {input_size} columns are not whole blocks of {block_quant.BLOCK}")
        rows, nb = sum(output_sizes), input_size // block_quant.BLOCK
        codes = torch.empty(rows, input_size // 2, dtype=torch.uint8) if self.bits == 4 else \
            torch.empty(rows, input_size, dtype=torch.int8)
        layer.register_buffer("codes", codes)
        layer.register_buffer("scales", torch.empty(rows, nb, dtype=torch.float32))
        layer.register_buffer("offsets", torch.empty(rows, nb, dtype=torch.float32) if self.bits == 4 else None)

    def load(self, layer, weight, rows, src_rows, src_cols):
        if src_cols != slice(None):
            raise ValueError("GGUF blocks cannot be split by columns (tensor parallelism) yet")
        codes, scales, offsets, bits = weight.blocks()
        if bits != self.bits:
            raise ValueError(f"holds {bits}-bit blocks, expected {self.bits}-bit")
        for dest, src in ((layer.codes, codes), (layer.scales, scales), (layer.offsets, offsets)):
            if dest is not None:
                src = torch.from_numpy(src[src_rows]).view(dest.dtype)
                if tuple(dest[rows].shape) != tuple(src.shape):
                    raise ValueError(f"has blocks of shape {tuple(src.shape)}, expected {tuple(dest[rows].shape)}")
                dest[rows].copy_(src)

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if flat.shape[0] <= FUSED_MAX_TOKENS:
            out = block_quant.matmul(flat, layer.codes, layer.scales, layer.offsets, self.bits)
        else:
            n, k = layer.codes.shape[0], layer.scales.shape[1] * block_quant.BLOCK
            weight = block_quant.dequantize(layer.codes, layer.scales, layer.offsets, self.bits,
                                            out=block_quant.workspace(n, k))
            out = flat @ weight.t()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])


class GGUFConfig(QuantizationConfig):
    """Per layer: blocks when every shard of the layer is Q4_0/Q4_1/Q8_0 with one bit width, else
    dense. `tensor_types`: GGUF type name by checkpoint (HF) tensor name."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]) -> None:
        super().__init__()
        self.tensor_types = dict(tensor_types)
        if "lm_head.weight" not in self.tensor_types and "model.embed_tokens.weight" in self.tensor_types:
            # a tied output head reads the embedding's blocks
            self.tensor_types["lm_head.weight"] = self.tensor_types["model.embed_tokens.weight"]

    def linear_method(self, prefix: str) -> LinearMethod:
        types = [self.tensor_types.get(name) for name in self.checkpoint_names(prefix)]
        bits = {_BITS.get(t) for t in types}
        if all(t in BLOCK_QUANT_TYPES for t in types) and len(bits) == 1:
            return BlockQuantLinearMethod(bits.pop())
        return UnquantizedLinearMethod()
