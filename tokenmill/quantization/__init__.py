"""Weight formats, each a `QuantizationConfig` + `LinearMethod` (see `base.py`).

`--quantization` takes one of `QUANTIZATION_METHODS`:
  auto     - for a GGUF file on CPU when the C++ kernel builds: `gguf-q8` (the fast mode) with the
             default dtype, `gguf` (the exact mode) with an explicit `--dtype float32`; else `none`
  none     - dense weights in the compute dtype (other GGUF types are dequantized at load)
  gguf     - keep a GGUF file's quantized blocks packed, float32 activations: exactly the file's
             weights, the same results as transformers on the dequantized file (`gguf.py`)
  gguf-q8  - the same packed weights, activations rounded to int8 per 32 values so the kernel multiplies
             integers, as llama.cpp does: faster, not exact, and not batch-invariant (the rounding
             turns float-order differences between batchings, chunkings and prefix hits into
             different tokens now and then, as in llama.cpp and vLLM)
  int8     - quantize every linear layer to per-row int8 on load (`int8.py`, CPU)
"""

from __future__ import annotations

import torch

from tokenmill.quantization.base import LinearMethod, QuantizationConfig

QUANTIZATION_METHODS = ("auto", "none", "gguf", "gguf-q8", "int8")

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "get_quantization_config",
           "resolve_quantization"]


def resolve_quantization(quantization: str | None, checkpoint_kind: str, device: torch.device,
                         dtype: torch.dtype, exact: bool = False) -> str:
    """The weight format to run, "auto" resolved (`exact`: the dtype was asked for, not defaulted)."""
    from tokenmill.kernels import block_quant

    if quantization in (None, "none", "int8"):
        return quantization or "none"
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {quantization!r}")
    native = checkpoint_kind == "gguf" and device.type == "cpu" and dtype == torch.float32
    if quantization == "auto":
        if not native or block_quant.load() is None:
            return "none"
        return "gguf" if exact else "gguf-q8"
    if not native:
        raise ValueError(f"quantization '{quantization}' runs a GGUF file's own blocks on CPU in float32; "
                         f"got a {checkpoint_kind} model on {device.type} in {dtype}")
    if block_quant.load() is None:
        raise ValueError(f"quantization '{quantization}' needs the C++ CPU kernel, which could not be built here "
                         "(see the warning above); use --quantization none")
    return quantization


def get_quantization_config(method: str, checkpoint, device: torch.device) -> QuantizationConfig:
    """The config for a resolved method name; `checkpoint` is the open GGUF or HF checkpoint."""
    if method in ("gguf", "gguf-q8"):
        from tokenmill.quantization.gguf import GGUFConfig

        return GGUFConfig(checkpoint.tensor_types(), int8_activations=method == "gguf-q8")
    if method == "int8":
        from tokenmill.quantization.int8 import Int8Config

        return Int8Config(device)
    from tokenmill.quantization.unquantized import UnquantizedConfig

    return UnquantizedConfig()
