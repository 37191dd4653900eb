"""`LoRAManager`: the model runner's LoRA adapters. Every linear layer of the decoder (attention and
MLP projections) gets a `LoRAWeights` with `max_loras` slots; an adapter loaded by name takes a free
slot (its factors copied in, zeros elsewhere), unloading clears it. Each step the runner describes
which tokens run which slot (`batch`), and the layers add each group's delta (`LoRAWeights.add_to`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.kernels.lora import Segments
from tokenmill.layers.embedding import LMHead
from tokenmill.layers.linear import LinearBase
from tokenmill.lora.peft import LoRAError, read_peft_adapter
from tokenmill.lora.weights import LoRAWeights


@dataclass
class LoRABatch:
    """Which rows of the step's flat batch run which adapter slot, in the two forms the layers use:
    `groups`, per slot (slot, its rows or None for every row, its scaling), for the torch path, and
    `segments`, runs of consecutive rows on one slot (the base model's included), for the CPU kernel."""

    groups: list[tuple[int, torch.Tensor | None, float]]
    segments: Segments


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.config, self.device = model, config, device
        self.layers: dict[str, LoRAWeights] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and not isinstance(module, LMHead):
                if module.tp_size != 1:
                    raise ValueError("LoRA adapters do not run with tensor parallelism yet")
                module.lora = LoRAWeights(
                    module.input_size,
                    module.output_partition_sizes,
                    config.max_loras,
                    config.max_lora_rank,
                    dtype,
                    device,
                )
                self.layers[name] = module.lora
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.scaling = [0.0] * config.max_loras  # per slot

    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` into a free slot (LoRAError if it cannot be)."""
        if name in self.slots:
            raise LoRAError(f"a LoRA adapter named {name!r} is loaded already", "lora_name")
        free = sorted(set(range(self.config.max_loras)) - set(self.slots.values()))
        if not free:
            raise LoRAError(f"{self.config.max_loras} adapters are loaded (--max-loras); unload one first", "lora_name")
        adapter = read_peft_adapter(path, self.model, self.config.max_lora_rank)
        slot = free[0]
        try:
            for f in adapter.factors:
                layer = self.layers.get(f.module)
                if layer is None:
                    raise LoRAError(f"the adapter adapts {f.module}, which takes no LoRA here")
                layer.set(slot, f.shard, f.a, f.b)
        except (LoRAError, ValueError) as e:
            self._clear(slot)
            raise LoRAError(str(e)) from None
        self.slots[name] = slot
        self.scaling[slot] = adapter.scaling

    def unload(self, name: str) -> None:
        self._clear(self.slots.pop(name))

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)

    def batch(self, names: list[str | None], num_tokens: np.ndarray) -> LoRABatch | None:
        """The step's groups: request i (adapter `names[i]`, None for the base model) has
        `num_tokens[i]` consecutive rows of the flat batch. None when no request runs an adapter."""
        if not any(names):
            return None
        per_request = np.array([self.slots[n] if n else -1 for n in names], dtype=np.int64)
        slots = np.repeat(per_request, num_tokens)
        groups = []
        for slot in np.unique(slots[slots >= 0]).tolist():
            rows = np.flatnonzero(slots == slot)
            whole = len(rows) == len(slots)
            groups.append((slot, None if whole else torch.from_numpy(rows).to(self.device), self.scaling[slot]))
        starts = np.flatnonzero(np.diff(slots, prepend=-2))  # where each run of one slot begins
        run_slots = slots[starts]
        scales = np.array([self.scaling[s] if s >= 0 else 0.0 for s in run_slots.tolist()], dtype=np.float32)
        segments = Segments(
            torch.from_numpy(np.append(starts, len(slots)).astype(np.int64)),
            torch.from_numpy(run_slots),
            torch.from_numpy(scales),
        )
        return LoRABatch(groups, segments)
