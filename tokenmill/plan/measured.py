"""Measured figures against this machine's roofline: what share of its memory bandwidth a decode rate
uses, and what share of its matmul rate a prefill (or batch) rate does, from the model's facts
(`model_facts`) and the hardware record (`hardware.py`). `tokenmill bench` adds these lines to its
results and `tokenmill doctor` reads them to tell a bandwidth-bound deployment from an overhead-bound one.
"""

from __future__ import annotations

from tokenmill.plan.hardware import Hardware, cache_path, resolve_hardware
from tokenmill.plan.model_facts import WEIGHT_BITS, ModelFacts, model_facts

# the engine's --quantization to the weight format whose bytes a decode step reads ("file": the
# checkpoint's own blocks or tensors, as a GGUF file runs by default)
_FORMATS = {"int8": "int8", "int4": "int4", "fp8": "fp8", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}


def machine_and_model(hardware: str, local: bool, model: str | None) -> tuple[Hardware, ModelFacts] | str:
    """The hardware to set figures against and the served model's facts, or why there are none.
    `hardware`: "cached" (this machine's record from `tokenmill plan`, if it measured one), "auto" (that
    record, measured now if missing), "none", or a named machine; this machine's only when the server
    runs here (`local`)."""
    if hardware == "none":
        return "--hardware none"
    if hardware in ("cached", "auto") and not local:
        return "the server is not on this machine (name its hardware with --hardware)"
    if hardware == "cached" and not cache_path().is_file():
        return f"this machine is not measured yet ({cache_path()}): run `tokenmill plan` once, or pass --hardware auto"
    if not model:
        return "the served model's file is unknown (pass --tokenizer with its path or alias)"
    try:
        return resolve_hardware("auto" if hardware == "cached" else hardware), model_facts(model)
    except (ValueError, FileNotFoundError, OSError) as e:
        return f"{model}: {e}"


def weight_format(facts: ModelFacts, quantization: str | None, dtype: str | None = None) -> str:
    """The `ModelFacts.weight_bytes` format of a served model: a quantize-on-load method's own, dense
    weights at the compute dtype's width when the file is converted (`none` on a GGUF file), else
    the file's own."""
    if quantization in _FORMATS:
        return _FORMATS[quantization]
    if quantization == "none" and dtype:
        return "float32" if "32" in dtype else "float16"
    return "file" if facts.file_bytes is not None else "float16"


def decode_share(
    facts: ModelFacts,
    hw: Hardware,
    fmt: str,
    step_seconds: float,
    batch: float = 1,
    context: int = 0,
    kv_dtype: str = "float16",
) -> dict:
    """A decode step of `batch` sequences at `context` tokens that took `step_seconds`: the bytes it
    reads (weights once, each sequence's KV), the bandwidth that is, and its share of the machine's."""
    batch = max(batch, 1)
    step_bytes = facts.decode_step_bytes(fmt, batch, context, kv_dtype, round(batch))
    achieved = step_bytes / step_seconds
    return {
        "bytes_per_step": step_bytes,
        "achieved_bytes_per_s": achieved,
        "machine_bytes_per_s": hw.bandwidth,
        "share": achieved / hw.bandwidth,
        "roofline_tokens_per_s": batch * hw.bandwidth / step_bytes,
    }


def compute_share(facts: ModelFacts, hw: Hardware, fmt: str, tokens_per_s: float, context: int = 0) -> dict:
    """`tokens_per_s` tokens through the model (prefill, or a batch's tokens) with attention over
    `context` / 2 earlier tokens on average: the FLOP/s that is and its share of the matmul rate the
    engine runs this format at (`Hardware.compute_rate`)."""
    kind, rate = hw.compute_rate(fmt if fmt in WEIGHT_BITS else "int8")
    flops_per_token = facts.flops_per_token(context, prefill=True)
    achieved = tokens_per_s * flops_per_token
    return {
        "flops_per_token": flops_per_token,
        "achieved_flops_per_s": achieved,
        "machine_flops_per_s": rate,
        "compute": kind,
        "share": achieved / rate,
    }
