"""Reading a PEFT LoRA adapter directory into factors per base linear layer.

PEFT stores, per adapted module `M` (a checkpoint name such as `model.layers.0.self_attn.q_proj`),
`base_model.model.M.lora_A.weight` [r, in] and `base_model.model.M.lora_B.weight` [out, r]; the layer
computes base(x) + lora_B(lora_A(x)) * scaling with scaling = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora). A checkpoint module maps to one of our layers and a shard of it as the base
checkpoint's tensors do (`models.utils.checkpoint_targets`: q/k/v -> qkv_proj shards 0/1/2)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from tokenmill.models.utils import checkpoint_targets

_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """An adapter that cannot be loaded (the client's input: a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class LoRAFactors:
    """One adapter's factors for one shard of one of our layers."""

    module: str  # our layer's name, e.g. model.layers.0.self_attn.qkv_proj
    shard: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out rows of the shard, r]


@dataclass
class PeftAdapter:
    rank: int
    scaling: float
    factors: list[LoRAFactors]


_MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes


def read_peft_adapter(path: str, model: nn.Module, max_rank: int) -> PeftAdapter:
    """The adapter at `path`, mapped onto `model`'s layers; LoRAError saying what is unsupported."""
    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    try:
        found = config_file.is_file() and weights_file.is_file()
        small = found and config_file.stat().st_size <= _MAX_CONFIG_BYTES
    except OSError as e:  # a name too long, a path that cannot be looked at
        raise LoRAError(f"cannot read the adapter at {path[:200]}: {e.strerror}") from None
    if not found:
        raise LoRAError(f"{path} is not a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    if not small:  # (read in the engine's loop: a huge file would hold up every request)
        raise LoRAError(f"{config_file} is over {_MAX_CONFIG_BYTES} bytes: not an adapter's config")
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except Exception as e:  # noqa: BLE001 - unreadable, not JSON, not safetensors (SafetensorError): the client's file
        raise LoRAError(f"cannot read the adapter at {path}: {str(e)[:200]}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter_config.json must hold a JSON object, got {type(config).__name__}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"adapter_config.json: r must be an int >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"adapter_config.json: lora_alpha must be a finite number, got {str(alpha)[:40]!r}")
    broken = next((name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if broken is not None:
        raise LoRAError(f"the adapter's tensor {broken} holds NaN or infinite values")
    if rank > max_rank:
        raise LoRAError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    unsupported = [
        key
        for key, ok in (
            ("use_dora", not config.get("use_dora")),
            ("fan_in_fan_out", not config.get("fan_in_fan_out")),
            ("bias", config.get("bias", "none") == "none"),
            ("modules_to_save", not config.get("modules_to_save")),
            ("rank_pattern", not config.get("rank_pattern")),
            ("alpha_pattern", not config.get("alpha_pattern")),
        )
        if not ok
    ]
    if unsupported:
        raise LoRAError(f"adapter_config.json: {', '.join(unsupported)} not supported (plain LoRA only)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem, _, part = name.removesuffix(".weight").rpartition(".")
        if not name.startswith(_PREFIX) or part not in ("lora_A", "lora_B"):
            raise LoRAError(f"the adapter's tensor {name} is not a LoRA factor of a linear layer")
        pairs.setdefault(stem.removeprefix(_PREFIX), {})[part] = tensor
    if not pairs:
        raise LoRAError(f"the adapter at {path} has no LoRA tensors")
    return PeftAdapter(rank, scaling, [_factors(model, m, p, rank) for m, p in sorted(pairs.items())])


def _factors(model: nn.Module, module: str, pair: dict[str, torch.Tensor], rank: int) -> LoRAFactors:
    if set(pair) != {"lora_A", "lora_B"}:
        raise LoRAError(f"the adapter's {module} lacks lora_A or lora_B")
    targets = list(checkpoint_targets(model, f"{module}.weight"))
    if len(targets) != 1:
        raise LoRAError(f"the adapter's {module} is not a linear layer of this model")
    name, _, shard = targets[0]
    a, b = pair["lora_A"], pair["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise LoRAError(f"the adapter's {module} factors are {list(a.shape)} and {list(b.shape)}, not rank {rank}")
    return LoRAFactors(name, shard or 0, a, b)
