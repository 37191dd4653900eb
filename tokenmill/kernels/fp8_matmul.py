"""Matmul on float8 e4m3 weights, on CPU: w = e4m3(byte) * scale, one float32 scale per output row
and group of `group` input columns (group = K: per channel; 128: the fine-grained checkpoints'
128x128 blocks, each block's scale repeated over its rows). The weights are dequantized inside the
matmul: each weight value becomes exactly the float32 `weight.float() * scale` (one rounding) that
`dequantize` writes and torch would compute, so the kernel reads 1 byte per weight instead of 4.

Layout, per weight row of K values:
  weight  uint8 [N, K]: the float8_e4m3fn bytes (a `torch.float8_e4m3fn` tensor viewed as uint8).
  scales  float32 [N, ceil(K / group)].
An e4m3 byte converts exactly with paged_attention's fp8 conversion (mantissa times a power of two
built in the exponent bits, so no float32 subnormal is ever formed and the model runner's
flush-to-zero setting cannot drop e4m3 subnormals). NaN (bytes 0x7F, 0xFF) converts to +-480
instead: quantizers never write it.
`matmul` handles few rows of activations (decode): each weight row is read once per 4 activation
rows, converted in registers (AVX2 when built for it, else a scalar path) and accumulated; larger
batches `dequantize` into a float32 workspace and run torch's GEMM. The C++ is csrc/fp8_matmul.cpp.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels


def load():
    """The compiled extension (`tokenmill.kernels.cpu_kernels`), or None when there is none here."""
    return cpu_kernels()


def _bytes(weight: torch.Tensor) -> torch.Tensor:
    return weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight


def matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ (weight [N, K] e4m3 * scales [N, ceil(K / group)]).T -> [M, N]."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    load().fp8_matmul(x, _bytes(weight), scales, group, out)
    return out


def dequantize(weight: torch.Tensor, scales: torch.Tensor, group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] (into `out` when given)."""
    if out is None:
        out = torch.empty(*weight.shape, dtype=torch.float32)
    load().fp8_dequantize(_bytes(weight), scales, group, out)
    return out
