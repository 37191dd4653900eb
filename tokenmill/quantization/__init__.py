"""Weight formats, each a `QuantizationConfig` + `LinearMethod` (see `base.py`).

`--quantization` takes one of `QUANTIZATION_METHODS`:
  auto     - a checkpoint's own format: for a GGUF file on CPU when the C++ kernel builds `gguf-q8`
             (the fast mode) with the default dtype, `gguf` (the exact mode) with an explicit
             `--dtype float32`; for an HF checkpoint with a `quantization_config` its method
             (awq, gptq, fp8); else `none`
  none     - dense weights in the compute dtype (other GGUF types are dequantized at load)
  gguf     - keep a GGUF file's quantized blocks packed, float32 activations: exactly the file's
             weights, the same results as transformers on the dequantized file (`gguf.py`)
  gguf-q8  - the same packed weights, activations rounded to int8 per 32 values so the kernel multiplies
             integers, as llama.cpp does: faster, not exact, and not batch-invariant (the rounding
             turns float-order differences between batchings, chunkings and prefix hits into
             different tokens now and then, as in llama.cpp and vLLM)
  int8     - a dense checkpoint quantized on load to int8 per output row (`int_quant.py`)
  int4     - the same to int4 per group of 32/64/128 columns, symmetric or with a minimum
  awq      - an AutoAWQ checkpoint (4 bits), unpacked into the same blocks (`awq_gptq.py`)
  gptq     - an AutoGPTQ checkpoint (4 or 8 bits, with or without act-order)
  fp8      - float8 e4m3 weights with float32 scales (`fp8.py`): a dense checkpoint quantized on load
             per output row, or an fp8 checkpoint (128x128 block scales as DeepSeek-V3, or per tensor /
             channel); its own C++ kernel on CPU (float32 activations), torch._scaled_mm on CUDA 8.9+
  mxfp4    - a dense checkpoint quantized on load to FP4 e2m1 with a power-of-two scale per 32 values
             (MoE experts too), or a checkpoint in it (GPT-OSS: its experts; its other layers are dense)
  nvfp4    - the same with an e4m3 scale per 16 values and a float32 one per tensor (`fp4.py`)
  compressed-tensors - an llm-compressor checkpoint (`compressed_tensors.py`): fp8 (float-quantized),
             int4/int8 (pack-quantized, naive-quantized, int-quantized), NVFP4 and MXFP4 (nvfp4- and
             mxfp4-pack-quantized), each run by the method above that holds the same weights
The integer methods (int8 .. gptq) and FP4 run the block kernels on CPU like gguf-q8 (int8 activations),
or like gguf (float32 activations, exactly the quantized weights) with an explicit `--dtype float32`;
on CUDA a Triton kernel that dequantizes the same packed blocks inside the GEMM (activations in the
compute dtype).
"""

from __future__ import annotations

import torch

from tokenmill.quantization.base import LinearMethod, QuantizationConfig

QUANTIZATION_METHODS = (
    "auto",
    "none",
    "gguf",
    "gguf-q8",
    "int8",
    "int4",
    "awq",
    "gptq",
    "fp8",
    "mxfp4",
    "nvfp4",
    "compressed-tensors",
)
# read from an HF checkpoint's quantization_config
CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "mxfp4", "compressed-tensors")
ON_LOAD_METHODS = ("int8", "int4", "fp8", "mxfp4", "nvfp4")  # applied to a dense checkpoint (fp8, mxfp4: either)

__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethod",
    "QuantizationConfig",
    "get_quantization_config",
    "resolve_quantization",
]


def resolve_quantization(
    quantization: str | None,
    checkpoint_kind: str,
    device: torch.device,
    dtype: torch.dtype,
    exact: bool = False,
    checkpoint_method: str | None = None,
) -> str:
    """The weight format to run, "auto" resolved (`exact`: the dtype was asked for, not defaulted;
    `checkpoint_method`: the `quant_method` of an HF checkpoint's quantization_config)."""
    from tokenmill.kernels import block_quant

    quantization = quantization or "none"
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {quantization!r}")
    if checkpoint_method is not None:
        if checkpoint_method not in CHECKPOINT_METHODS:
            raise ValueError(
                f"the checkpoint's quantization_config has quant_method {checkpoint_method!r}, which is "
                f"not supported (supported: {', '.join(CHECKPOINT_METHODS)})"
            )
        if quantization not in ("auto", checkpoint_method):
            raise ValueError(
                f"--quantization {quantization} disagrees with the checkpoint's quantization_config "
                f"(quant_method {checkpoint_method!r}); use --quantization auto or {checkpoint_method}"
            )
        quantization = checkpoint_method
    elif quantization in CHECKPOINT_METHODS and quantization not in ON_LOAD_METHODS:
        raise ValueError(
            f"--quantization {quantization} reads a checkpoint quantized with {quantization.upper()}; "
            "this one has no quantization_config"
        )
    if quantization in ON_LOAD_METHODS and checkpoint_kind != "hf":
        raise ValueError(
            f"--quantization {quantization} quantizes a dense HF checkpoint on load; a GGUF file keeps "
            "its own blocks (--quantization auto)"
        )
    if quantization == "none":
        return quantization
    if quantization == "fp8":  # CPU (its own kernel) or CUDA
        from tokenmill.quantization.fp8 import check_device

        check_device(device, dtype)
        return quantization
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if quantization == "auto":
        if checkpoint_kind != "gguf" or not cpu_float32 or block_quant.load() is None:
            return "none"
        return "gguf" if exact else "gguf-q8"
    if quantization in ("gguf", "gguf-q8") and (checkpoint_kind != "gguf" or not cpu_float32):
        raise ValueError(
            f"quantization '{quantization}' runs a GGUF file's own blocks on CPU in float32; "
            f"got a {checkpoint_kind} model on {device.type} in {dtype}"
        )
    if quantization == "compressed-tensors":  # each scheme checks its own device needs when the config is built
        return quantization
    check_block_kernels(f"quantization '{quantization}'", device, dtype)
    return quantization


def check_block_kernels(what: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError naming `what` unless the block-quantized weights run here: on CPU in float32
    (the C++ kernels) or on CUDA (the Triton kernel, `kernels/triton_block.py`)."""
    from tokenmill.kernels import block_quant, triton_block

    if device.type == "cuda":
        if not triton_block.available():
            raise ValueError(f"{what} runs a Triton kernel on CUDA, and Triton is not installed (pip install triton)")
        return
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"{what} runs the block kernels on CPU in float32 or on CUDA; got {device.type} in {dtype}")
    if block_quant.load() is None:
        raise ValueError(
            f"{what} needs the C++ CPU kernel, which could not be built here "
            "(see the warning above); use --quantization none"
        )


def get_quantization_config(
    method: str,
    checkpoint,
    device: torch.device,
    exact: bool = False,
    group_size: int | None = None,
    symmetric: bool | None = None,
    dtype: torch.dtype = torch.float32,
) -> QuantizationConfig:
    """The config for a resolved method name; `checkpoint` is the open GGUF or HF checkpoint; `exact`:
    float32 activations for the integer methods; `group_size`, `symmetric`: for int8/int4; `dtype`:
    the compute dtype."""
    if method == "compressed-tensors":
        from tokenmill.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig(checkpoint.quantization_config, checkpoint.tensor_names(), device, dtype, exact)
    if method in ("gguf", "gguf-q8"):
        from tokenmill.quantization.gguf import GGUFConfig

        return GGUFConfig(checkpoint.tensor_types(), int8_activations=method == "gguf-q8")
    if method == "fp8":
        from tokenmill.quantization.fp8 import FP8Config

        if getattr(checkpoint, "quant_method", None) == "fp8":
            return FP8Config(checkpoint.quantization_config, checkpoint.tensor_names())
        return FP8Config()
    if method in ("mxfp4", "nvfp4"):
        from tokenmill.quantization.fp4 import FP4Config

        return FP4Config(
            method, int8_activations=not exact, experts_only=getattr(checkpoint, "quant_method", None) == "mxfp4"
        )
    if method in ON_LOAD_METHODS:
        from tokenmill.quantization.int_quant import IntQuantConfig

        return IntQuantConfig(int(method[3:]), group_size, symmetric, int8_activations=not exact)
    if method in CHECKPOINT_METHODS:
        from tokenmill.quantization.awq_gptq import AWQGPTQConfig

        return AWQGPTQConfig(method, checkpoint.quantization_config, checkpoint.tensor_names(), exact)
    from tokenmill.quantization.unquantized import UnquantizedConfig

    return UnquantizedConfig()
