"""`load_model`: one entry point for GGUF files and HF directories."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import ModelConfig, resolve_device, resolve_dtype
from tokenmill.loader.gguf_loader import GGUFCheckpoint
from tokenmill.loader.hf_loader import HFCheckpoint
from tokenmill.loader.source import ModelSource, resolve_model
from tokenmill.models import MODEL_REGISTRY
from tokenmill.kernels import block_quant
from tokenmill.models.quantization import install_block_quant_layers, quantize_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    quantization: str  # what was applied: "none", "gguf" or "int8"


def open_checkpoint(source: ModelSource) -> GGUFCheckpoint | HFCheckpoint:
    return GGUFCheckpoint(source.path) if source.kind == "gguf" else HFCheckpoint(source.path)


def load_model(model: str | None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               max_positions: int | None = None, quantization: str = "auto") -> LoadedModel:
    """Load `model` (alias, .gguf file or HF directory) onto `device` in `dtype`. `quantization`:
    "auto" keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks on CPU in float32 (else "none"), "gguf" insists
    on that, "int8" quantizes the linear layers after loading, "none" computes on dense weights."""
    start = time.perf_counter()
    source = resolve_model(model)
    dev = resolve_device(device)
    ckpt = open_checkpoint(source)
    config = ckpt.config
    torch_dtype = resolve_dtype(dtype, dev, config.torch_dtype)
    method = resolve_quantization(quantization, source, dev, torch_dtype)
    model_cls = MODEL_REGISTRY[config.architecture]
    with torch.device("meta"):
        net = model_cls(config, max_positions or config.max_position_embeddings)
    net = net.to_empty(device=dev).to(torch_dtype)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    with torch.no_grad():
        kept = install_block_quant_layers(net, ckpt.weights()) if method == "gguf" else set()
        net.load_weights(
            (name, w.dequantize() if hasattr(w, "dequantize") else w) for name, w in ckpt.weights() if name not in kept
        )
    if method == "int8":
        quantize_model(net, method, dev)
    net.eval()
    logger.info("loaded %s (%s, %s, quantization %s) in %.1fs", source.name, config.architecture, torch_dtype,
                method, time.perf_counter() - start)
    return LoadedModel(net, config, source, torch_dtype, dev, method)


def resolve_quantization(quantization: str | None, source: ModelSource, device: torch.device,
                         dtype: torch.dtype) -> str:
    """The weight format to run: "none", "gguf" or "int8" (see `load_model`)."""
    if quantization in (None, "none", "int8"):
        return quantization or "none"
    native = source.kind == "gguf" and device.type == "cpu" and dtype == torch.float32
    if quantization == "auto":
        return "gguf" if native and block_quant.load() is not None else "none"
    if quantization != "gguf":
        raise ValueError(f"quantization must be one of auto, none, gguf, int8; got {quantization!r}")
    if not native:
        raise ValueError("quantization 'gguf' runs a GGUF file's own blocks on CPU in float32; "
                         f"got a {source.kind} model on {device.type} in {dtype}")
    if block_quant.load() is None:
        raise ValueError("quantization 'gguf' needs the C++ CPU kernel, which could not be built here "
                         "(see the warning above); use --quantization none")
    return "gguf"
