"""Which attention backend a model runner uses, kept apart from the interface (`backend.py`) so the
interface does not import every implementation and its kernels."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import paged_attention


def get_attention_backend(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> AttentionBackend:
    """The compiled paged kernel on CPU when compute is float32 (the cache float32, float16, bfloat16,
    int8 or fp8) and it builds, else torch ops."""
    if (
        device.type == "cpu"
        and dtype == torch.float32
        and cache_dtype in paged_attention.CACHE_DTYPES
        and paged_attention.load() is not None
    ):
        return CpuPagedBackend()
    return TorchSDPABackend()
