"""`int8` and `int4`: a dense checkpoint's linear weights quantized on load, straight into the block
layout the GGUF kernels run (`gguf.BlockLayout`, `block_quant.Blocks`), so they share its fused
kernels: int8 activations with integer dot products by default, float32 activations with
`--dtype float32` (exactly the quantized weights).

- int8: one scale per output row (per channel), or per group; symmetric by default (codes -128..127).
- int4: one scale per group of 32, 64 or 128 columns (default 32); symmetric (codes -8..7, as Q4_0)
  or asymmetric (a minimum per group, codes 0..15, as Q4_1; the default).
Scales (and minimums) are rounded to float16 before the codes are chosen, so the stored weights are
exactly code * scale + minimum. The kernels hold a scale per 32 columns whatever the group: a larger
group repeats its scale (the same bytes as group 32 for a less exact fit; accepted so that settings
match other engines'). The LM head keeps 8 bits per channel under int4, as llama.cpp's Q4 files keep a
wider type for the output tensor: the head is a large share of a small model and its errors go
straight into the logits.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.quantization.base import LinearMethod, QuantizationConfig, dense
from tokenmill.quantization.gguf import BlockLayout, BlockQuantLinearMethod
from tokenmill.quantization.gguf_codes import Codes

GROUP_SIZES = (32, 64, 128)


def quantize(weight: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> Codes:
    """`weight` [N, K] as codes of `bits` with a float16 scale (and minimum unless `symmetric`) per
    `group` columns (None: the whole row)."""
    rows, cols = weight.shape
    group = group or cols
    w = weight.detach().float().cpu().numpy().reshape(rows, cols // group, group)
    lo, hi = w.min(-1), w.max(-1)
    levels = 2**bits - 1
    tiny = np.float32(2.0**-24)  # the smallest float16 step: an all-zero group keeps a usable scale
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = np.maximum(np.maximum(-lo, hi) / qmax, tiny).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(w / scale[..., None]), -qmax - 1, qmax)
        offset = None
    else:
        scale = np.maximum((hi - lo) / levels, tiny).astype(np.float16).astype(np.float32)
        shift = 2 ** (bits - 1) if bits == 8 else 0  # 8-bit codes are stored signed
        offset = (lo + shift * scale).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((w - offset[..., None]) / scale[..., None]), -shift, levels - shift)
    center = 2 ** (bits - 1) if symmetric and bits < 8 else 0
    return Codes(q.astype(np.int16).reshape(rows, cols), scale, offset, group, bits, center)


class QuantizeOnLoadMethod(BlockQuantLinearMethod):
    def __init__(self, bits: int, group: int | None, symmetric: bool, int8_activations: bool) -> None:
        center = 2 ** (bits - 1) if symmetric and bits < 8 else 0
        super().__init__(BlockLayout(bits, 32, not symmetric, center), int8_activations)
        self.group, self.symmetric = group, symmetric

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if self.group and input_size % self.group:
            raise ValueError(
                f"{layer.prefix}: quantization_group_size {self.group} does not divide its {input_size} input columns"
            )
        super().create_weights(layer, input_size, output_sizes, params_dtype)

    def load(self, layer, weight, rows, src_rows, src_cols):
        self.write(layer, quantize(dense(weight)[src_rows, src_cols], self.bits, self.group, self.symmetric), rows)


class IntQuantConfig(QuantizationConfig):
    def __init__(self, bits: int, group_size: int | None, symmetric: bool | None, int8_activations: bool) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"integer weights have 4 or 8 bits, not {bits}")
        if group_size is not None and group_size not in GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}; got {group_size}"
            )
        self.name = f"int{bits}"
        self.bits, self.int8_activations = bits, int8_activations
        self.symmetric = bits == 8 if symmetric is None else symmetric
        self.group = group_size or (32 if bits == 4 else None)

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith("lm_head") and self.bits == 4:
            return QuantizeOnLoadMethod(8, None, True, self.int8_activations)
        return QuantizeOnLoadMethod(self.bits, self.group, self.symmetric, self.int8_activations)
