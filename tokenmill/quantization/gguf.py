"""`gguf` (the default for GGUF files on CPU in float32): linear layers keep the file's quantized
weights packed — Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K — and the matmul
dequantizes inside the kernel (`tokenmill.kernels.block_quant`), so the model computes on the same
float32 weights as the dequantized checkpoint while a decode step reads 3-7x fewer bytes.

Every type becomes w = scale * code + offset per block (`BlockLayout`): 4-bit codes in blocks of 32
where the codes fit 0..15 (Q4_0, Q4_1, Q4_K: a K-quant's 6-bit sub-scales and mins are folded into
per-block float32 scales and offsets), 8-bit codes otherwise (Q8_0, Q5_*, Q5_K; Q6_K in blocks of
16, its sub-block size). The folded scales are exact float32 products, so nothing changes value.
A fused layer whose shards come in different types takes the widest layout among them (a 4-bit
shard widened to 8-bit codes, a 32-block's scale repeated over two 16-blocks), again exactly.
Other types (Q2_K, Q3_K, floats) stay dense: dequantized at load.

The layer stores (the kernel's layout):
  4 bits: codes uint8 [N, K/2], in each 16-byte block byte j holds value j (low nibble) and value
          j+16 (high nibble), as in GGUF; scales and offsets float32 [N, K/32];
  8 bits: codes int8 [N, K]; scales float32 [N, K/block]; offsets float32 or none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels import block_quant
from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.gguf_codes import Codes
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

# batches up to this many tokens run the fused kernel; larger ones dequantize once and use torch's GEMM
FUSED_MAX_TOKENS = 16


@dataclass(frozen=True)
class BlockLayout:
    bits: int  # 4 or 8 per code
    block: int  # values per scale: 32, or 16
    offsets: bool

    def widest(self, other: BlockLayout) -> BlockLayout:
        return BlockLayout(max(self.bits, other.bits), min(self.block, other.block), self.offsets or other.offsets)


# each packed GGUF type's own layout (Q4_0's codes are stored 0..15 with offset -8 * scale)
LAYOUTS = {
    "Q4_0": BlockLayout(4, 32, True), "Q4_1": BlockLayout(4, 32, True), "Q4_K": BlockLayout(4, 32, True),
    "Q8_0": BlockLayout(8, 32, False), "Q5_0": BlockLayout(8, 32, False), "Q5_1": BlockLayout(8, 32, True),
    "Q5_K": BlockLayout(8, 32, True), "Q6_K": BlockLayout(8, 16, False),
}


def pack(codes: Codes, layout: BlockLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`codes` in `layout`: (codes uint8 [N, K/2] or int8 [N, K], scales, offsets) for the kernel."""
    q, scales, offsets = codes.q, codes.scales, codes.offsets
    if layout.block < codes.block:  # one scale (and offset) per smaller block
        repeat = codes.block // layout.block
        scales = np.repeat(scales, repeat, axis=1)
        offsets = None if offsets is None else np.repeat(offsets, repeat, axis=1)
    if layout.offsets and offsets is None:
        offsets = np.zeros_like(scales)
    if layout.bits == 8:
        return q.astype(np.int8), scales, offsets
    if q.min(initial=0) < 0:  # Q4_0: code - 8 stored as code with an offset of -8 * scale (exact)
        q, offsets = q + 8, offsets - 8 * scales
    nibbles = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)
    return (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(q.shape[0], -1), scales, offsets


class BlockQuantLinearMethod(LinearMethod):
    """`int8_activations`: the activations are rounded to int8 per 32 values; few-token steps then
    multiply integers (`block_quant.matmul_q8`), larger ones run the float GEMM on the rounded values
    (so a token's result does not depend on the batch it is in). Otherwise float32 activations, exact."""

    def __init__(self, layout: BlockLayout, int8_activations: bool = False) -> None:
        self.layout, self.int8_activations = layout, int8_activations
        self.bits = layout.bits

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if input_size % 32:
            raise ValueError(f"{layer.prefix}: {input_size} columns are not whole blocks of 32")
        rows, nb = sum(output_sizes), input_size // self.layout.block
        codes = torch.empty(rows, input_size // 2, dtype=torch.uint8) if self.bits == 4 else \
            torch.empty(rows, input_size, dtype=torch.int8)
        layer.register_buffer("codes", codes)
        layer.register_buffer("scales", torch.empty(rows, nb, dtype=torch.float32))
        layer.register_buffer("offsets", torch.empty(rows, nb, dtype=torch.float32) if self.layout.offsets else None)

    def load(self, layer, weight, rows, src_rows, src_cols):
        if src_cols != slice(None):
            raise ValueError("GGUF blocks cannot be split by columns (tensor parallelism) yet")
        codes = weight.codes()
        if codes.block % self.layout.block or LAYOUTS[weight.qtype.name].bits > self.bits:
            raise ValueError(f"holds {weight.qtype.name} blocks, which do not fit the layer's {self.layout}")
        for dest, src in zip((layer.codes, layer.scales, layer.offsets), pack(codes, self.layout)):
            if dest is not None:
                src = torch.from_numpy(np.ascontiguousarray(src[src_rows])).view(dest.dtype)
                if tuple(dest[rows].shape) != tuple(src.shape):
                    raise ValueError(f"has blocks of shape {tuple(src.shape)}, expected {tuple(dest[rows].shape)}")
                dest[rows].copy_(src)

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if flat.shape[0] <= FUSED_MAX_TOKENS:
            matmul = block_quant.matmul_q8 if self.int8_activations else block_quant.matmul
            out = matmul(flat, layer.codes, layer.scales, layer.offsets, self.bits)
        else:
            n, k = layer.codes.shape[0], layer.codes.shape[1] * 8 // self.bits
            weight = block_quant.dequantize(layer.codes, layer.scales, layer.offsets, self.bits,
                                            out=block_quant.workspace(n, k))
            if self.int8_activations:  # the same rounding as the kernel: a token's result never depends on its batch
                flat = block_quant.round_activations(flat)
            out = flat @ weight.t()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def decode_operands(self, layer):
        return (2 if self.int8_activations else 1, self.bits, [layer.codes, layer.scales, layer.offsets],
                FUSED_MAX_TOKENS)


class GGUFConfig(QuantizationConfig):
    """Per layer: packed when every shard of the layer has a packed type (in the widest layout among
    them), else dense. `tensor_types`: GGUF type name by checkpoint (HF) tensor name."""

    def __init__(self, tensor_types: dict[str, str], int8_activations: bool = False) -> None:
        super().__init__()
        self.name = "gguf-q8" if int8_activations else "gguf"
        self.int8_activations = int8_activations
        self.tensor_types = dict(tensor_types)
        if "lm_head.weight" not in self.tensor_types and "model.embed_tokens.weight" in self.tensor_types:
            # a tied output head reads the embedding's blocks
            self.tensor_types["lm_head.weight"] = self.tensor_types["model.embed_tokens.weight"]

    def linear_method(self, prefix: str) -> LinearMethod:
        types = [self.tensor_types.get(name) for name in self.checkpoint_names(prefix)]
        if not all(t in LAYOUTS for t in types):
            return UnquantizedLinearMethod()
        layout = LAYOUTS[types[0]]
        for t in types[1:]:
            layout = layout.widest(LAYOUTS[t])
        return BlockQuantLinearMethod(layout, self.int8_activations)
