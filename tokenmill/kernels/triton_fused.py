"""Fused elementwise kernels in Triton for the GPU path: residual add + RMSNorm, SiLU(gate) * up and
GeLU(gate) * up (tanh approximation, Gemma's gelu_pytorch_tanh, or erf). Each
is one pass over a row instead of torch's three to five kernels (add, float cast, mean of squares, scale,
weight), which at batch 1 are launch-bound. They round where the torch layers do (the sum and the
product in the compute dtype, the norm in float32, then times the weight in the compute dtype), so the
two paths agree to the dtype's rounding. Tested on CPU under TRITON_INTERPRET=1; the layers call them on
CUDA only. Triton is imported when a kernel is first used.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def applies(x: torch.Tensor) -> bool:
    """Whether the layers use these kernels for `x`: a contiguous 2-D CUDA tensor, Triton installed."""
    return x.is_cuda and x.dim() == 2 and x.is_contiguous() and available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps, HAS_RES: tl.constexpr, FP32: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64) * n
        i = tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + row + i, mask=mask, other=0.0)
        if HAS_RES:
            x = x + tl.load(res_ptr + row + i, mask=mask, other=0.0)  # rounded to the dtype, as torch's add
            tl.store(sum_ptr + row + i, x, mask=mask)
        xf = x.to(tl.float32)
        normed = xf / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + i, mask=mask, other=0.0)
        if FP32:
            y = normed * w
        else:  # the normed row rounded to the dtype, then times the weight in the dtype (HF's order)
            y = normed.to(x.dtype) * w
        tl.store(out_ptr + row + i, y, mask=mask)

    @triton.jit
    def act_and_mul_kernel(gate_up_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        """act(gate) * up, the activation's output rounded to the input dtype as torch's is. ACT: `SILU`,
        `GELU_TANH` or `GELU_ERF`."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        gate = tl.load(gate_up_ptr + row * 2 * n + i, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * n + n + i, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if ACT == 0:
            act = g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        else:  # 0.5 g (1 + erf(g / sqrt(2)))
            act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        tl.store(out_ptr + row * n + i, act.to(gate.dtype) * up, mask=mask)

    return add_rms_norm_kernel, act_and_mul_kernel


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x [T, N] (residual None: x itself)."""
    import triton

    add_rms_norm_kernel = _kernels()[0]
    t, n = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    add_rms_norm_kernel[(t,)](
        x, x if residual is None else residual.contiguous(), weight, out, total, n, eps,
        HAS_RES=residual is not None, FP32=x.dtype == torch.float32, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out, total


SILU, GELU_TANH, GELU_ERF = 0, 1, 2


def _act_and_mul(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    act_and_mul_kernel = _kernels()[1]
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    act_and_mul_kernel[(t, -(-n // block))](gate_up, out, n, ACT=act, BLOCK=block)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> silu(gate) * up, [T, I]."""
    return _act_and_mul(gate_up, SILU)


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """[T, 2 I] -> gelu(gate) * up, [T, I]; `approximate` as torch's gelu: "tanh" or "none" (erf)."""
    return _act_and_mul(gate_up, GELU_TANH if approximate == "tanh" else GELU_ERF)
