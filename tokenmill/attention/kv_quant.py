"""Quantized KV caches: K/V stored as int8 or fp8 (e4m3 / e5m2), one byte per value, with a scale per
token, kv head and tensor (K or V) in a tensor beside the blocks.

A layer's scales are `[2, num_blocks, block_size, num_kv_heads]` (K then V), addressed by the same
slots as its `[2, num_blocks, block_size, num_kv_heads, head_dim]` cache. A row x is stored as
round(x / s) (int8) or x / s rounded to the fp8 grid, with s = max|x| / the format's largest value
(127, 448, 57344), and read back as q * s. Scales are bfloat16: 2 bytes, not float32's 4, keep the cost
near half of a 16-bit cache (head dim 64: 66 bytes per row, not 68), and unlike float16 they do not
underflow (an e5m2 scale, max|x| / 57344, is below float16's normal range for any row with max|x| < 3.5).
The rounding of s itself costs nothing: rows are quantized with the stored (rounded) scale.
"""

from __future__ import annotations

import torch

QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANT_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}  # as the flag
SCALE_DTYPE = torch.bfloat16


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (values [..., D] in `dtype`, scales [...] bfloat16): one scale per row of D."""
    qmax = QUANT_MAX[dtype]
    x = x.float()
    scale = (x.abs().amax(-1) / qmax).clamp_min(2.0**-100).to(SCALE_DTYPE)  # an all-zero row: any scale
    y = (x / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] * scales [...] in `dtype`."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def write(values: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize `values` [T, KVH, D] into `cache` [blocks, bs, KVH, D] and `scales` [blocks, bs, KVH] at
    their slots (through byte views: there is no index_copy_ for fp8 on CPU)."""
    q, s = quantize(values, cache.dtype)
    cache.view(torch.uint8).view(-1, *values.shape[1:]).index_copy_(0, slot_mapping, q.view(torch.uint8))
    scales.view(-1, values.shape[1]).index_copy_(0, slot_mapping, s)
