"""`load_model`: one entry point for GGUF files and HF directories."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from tokenmill.distributed import expert_parallel
from tokenmill.kernels import block_quant
from tokenmill.layers.host_placement import NOTHING, HostPlacement, placing
from tokenmill.loader.gguf_loader import GGUFCheckpoint
from tokenmill.loader.hf_loader import HFCheckpoint
from tokenmill.loader.source import ModelSource, resolve_model
from tokenmill.models.registry import model_class
from tokenmill.quantization import QuantizationConfig, get_quantization_config, resolve_quantization
from tokenmill.quantization.gguf import HostExpertsConfig

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    quantization: str  # what was applied: a name of tokenmill.quantization.QUANTIZATION_METHODS, not "auto"
    host: HostPlacement = NOTHING  # weights built and loaded in host memory (--cpu-offload-gb, --cpu-moe)


def open_checkpoint(source: ModelSource) -> GGUFCheckpoint | HFCheckpoint:
    return GGUFCheckpoint(source.path) if source.kind == "gguf" else HFCheckpoint(source.path)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    quant_config: QuantizationConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    host: HostPlacement = NOTHING,
) -> nn.Module:
    """The model for `config` with uninitialised storage on `device` (parameters in `dtype`, quantized
    layers in their own formats), but the weights `host` names in host memory; `device` "meta"
    allocates nothing."""
    cls = model_class(config.architecture)
    quant_config.packed_modules = cls.packed_modules
    with torch.device(device), default_dtype(dtype), placing(host):
        return cls(config, quant_config, max_positions or config.max_position_embeddings)


def load_model(
    model: str | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    quantization: str = "auto",
    group_size: int | None = None,
    symmetric: bool | None = None,
    plan_host: Callable[[nn.Module], HostPlacement] | None = None,
) -> LoadedModel:
    """Load `model` (alias, .gguf file or HF directory) onto `device` in `dtype` with the weight format
    `quantization` (see `tokenmill.quantization`; `group_size` and `symmetric` for int8/int4).
    `plan_host`: given the model built on the meta device (its shapes, no memory), the weights to build
    and load in host memory instead (--cpu-offload-gb, --cpu-moe: `worker.offload`); a GGUF file's
    experts placed there keep their blocks, for the CPU block kernels (`gguf.HostExpertsConfig`)."""
    start = time.perf_counter()
    source = resolve_model(model)
    dev = resolve_device(device)
    ckpt = open_checkpoint(source)
    config = ckpt.config
    torch_dtype = resolve_dtype(dtype, dev, config.torch_dtype)
    exact = dtype != "auto"
    method = resolve_quantization(
        quantization, source.kind, dev, torch_dtype, exact, getattr(ckpt, "quant_method", None)
    )
    quant_config = get_quantization_config(method, ckpt, dev, exact, group_size, symmetric, torch_dtype)
    host = NOTHING
    if plan_host is not None:
        host = plan_host(build_model(config, quant_config, torch_dtype, torch.device("meta"), max_positions))
    if host.experts and source.kind == "gguf":
        int8 = not exact and block_quant.load() is not None  # as `resolve_quantization` picks on CPU
        quant_config = HostExpertsConfig(quant_config, ckpt.tensor_types(), host.experts, int8)
    net = build_model(config, quant_config, torch_dtype, dev, max_positions, host)
    with torch.no_grad():
        net.load_weights(ckpt.weights())
        for module in net.modules():
            if hasattr(module, "quant_method"):
                module.quant_method.process_after_loading(module)
    net.eval()
    logger.info(
        "loaded %s (%s, %s, quantization %s) in %.1fs",
        source.name,
        config.architecture,
        torch_dtype,
        quant_config.name,
        time.perf_counter() - start,
    )
    return LoadedModel(net, config, source, torch_dtype, dev, quant_config.name, host)


def load_configured_model(
    config: EngineConfig, plan_host: Callable[[nn.Module], HostPlacement] | None = None
) -> LoadedModel:
    """The model `config` names, as it asks (dtype, device, weight format), on this process's
    tensor-parallel rank (its experts, with expert parallelism); `plan_host` as `load_model` takes it."""
    with expert_parallel.placement(config.parallel.enable_expert_parallel):
        loaded = load_model(
            config.model,
            config.dtype,
            config.device,
            max_positions=config.scheduler.fixed_max_model_len,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
            symmetric=config.quantization_symmetric,
            plan_host=plan_host,
        )
    if config.parallel.enable_expert_parallel:
        expert_parallel.check_has_experts(loaded.config)
    return loaded
