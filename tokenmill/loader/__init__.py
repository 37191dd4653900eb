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
from tokenmill.models.quantization import quantize_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device


def open_checkpoint(source: ModelSource) -> GGUFCheckpoint | HFCheckpoint:
    return GGUFCheckpoint(source.path) if source.kind == "gguf" else HFCheckpoint(source.path)


def load_model(model: str | None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               max_positions: int | None = None, quantization: str | None = None) -> LoadedModel:
    """Load `model` (alias, .gguf file or HF directory) onto `device` in `dtype`, optionally
    quantizing its linear layers (`quantization="int8"`)."""
    start = time.perf_counter()
    source = resolve_model(model)
    dev = resolve_device(device)
    ckpt = open_checkpoint(source)
    config = ckpt.config
    torch_dtype = resolve_dtype(dtype, dev, config.torch_dtype)
    model_cls = MODEL_REGISTRY[config.architecture]
    with torch.device("meta"):
        net = model_cls(config, max_positions or config.max_position_embeddings)
    net = net.to_empty(device=dev).to(torch_dtype)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    with torch.no_grad():
        net.load_weights(
            (name, w.dequantize() if hasattr(w, "dequantize") else w) for name, w in ckpt.weights()
        )
    if quantization:
        quantize_model(net, quantization, dev)
    net.eval()
    logger.info("loaded %s (%s, %s) in %.1fs", source.name, config.architecture, torch_dtype,
                time.perf_counter() - start)
    return LoadedModel(net, config, source, torch_dtype, dev)
