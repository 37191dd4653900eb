"""Which attention backend a model runner uses, kept apart from the interface (`backend.py`) so the
interface does not import every implementation and its kernels.

`--attention-backend` (`EngineConfig.attention_backend`, checked at start by
`config.check_attention_backend`) names one; else `$TOKENMILL_ATTENTION_BACKEND` does (`torch-sdpa`,
`cpu-paged`, `triton-paged`: for A/B runs on a GPU, and for the tests, which run the Triton backend on CPU
in Triton's interpreter); else the choice below. FlashAttention (`flash-attn`) and FlashInfer
(`flashinfer`) are only ever named, never chosen: optional packages on CUDA."""

from __future__ import annotations

import importlib.util
import os

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.context_parallel import ContextParallelBackend
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import ParallelConfig
from tokenmill.kernels import paged_attention

BACKEND_ENV = "TOKENMILL_ATTENTION_BACKEND"


def get_attention_backend(
    device: torch.device,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    name: str = "auto",
    parallel: ParallelConfig | None = None,
) -> AttentionBackend:
    """With context parallelism (`parallel`) its own backend; else `name` ("auto":
    `$TOKENMILL_ATTENTION_BACKEND`, else on CUDA the Triton paged kernel when Triton is installed; on CPU
    the compiled paged kernel when compute is float32 (the cache float32, float16, bfloat16, int8 or fp8)
    and it builds; else torch ops)."""
    if parallel is not None and parallel.context_parallel_size > 1:
        return ContextParallelBackend(split_prefill=parallel.prefill_context_parallel_size > 1)
    if name == "auto":
        name = os.environ.get(BACKEND_ENV, "auto")
    if name == "auto":
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            name = "triton-paged"
        elif (
            device.type == "cpu"
            and dtype == torch.float32
            and cache_dtype in paged_attention.CACHE_DTYPES
            and paged_attention.load() is not None
        ):
            name = "cpu-paged"
        else:
            name = "torch-sdpa"
    if name == "triton-paged":
        from tokenmill.attention.triton_paged import TritonPagedBackend  # imports Triton

        return TritonPagedBackend()
    if name in ("flash-attn", "flashinfer"):  # their packages are imported when they first attend
        from tokenmill.attention.library_backends import FlashAttnBackend, FlashInferBackend

        return (FlashAttnBackend if name == "flash-attn" else FlashInferBackend)(dtype, cache_dtype)
    if name == "cpu-paged":
        return CpuPagedBackend()
    if name == "torch-sdpa":
        return TorchSDPABackend()
    raise ValueError(
        f"${BACKEND_ENV} must be torch-sdpa, cpu-paged, triton-paged, flash-attn or flashinfer, got {name!r}"
    )
