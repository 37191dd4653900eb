"""RMSNorm, computed in float32 as HF does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import fused_ops, triton_fused


class RMSNorm(nn.Module):
    """With `residual`, adds it first and also returns the sum, so each decoder layer does one fused
    add+norm instead of two passes (on CPU float32 one kernel call, which leaves the sum in `x`; on CUDA one
    Triton kernel)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_ops.applies(x) and x.dim() == 2 and x.is_contiguous():
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if triton_fused.applies(x):  # CUDA: one Triton pass
            return triton_fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x), x
        x = x + residual
        return self._norm(x), x
