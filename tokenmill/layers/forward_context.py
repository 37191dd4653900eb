"""What a forward pass needs besides its inputs: the step's attention metadata, by KV-cache group.
The model runner sets it around each forward; attention layers read it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class ForwardContext:
    attn_metadata: dict[int, object]  # KV-cache group index -> that group's backend metadata
    lora: object | None = None  # the step's `lora.manager.LoRABatch` when some of its tokens run an adapter
    # whether this rank adds the step's tokens to the MoE expert counters: with context parallelism
    # the counts are summed over the ranks, so a step every rank runs whole is counted on rank 0 only
    count_experts: bool = True


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a model runner step (no forward context is set)")
    return _current


def counts_experts() -> bool:
    """Whether this forward's tokens go into the MoE expert counters (True outside a step)."""
    return _current is None or _current.count_experts


def current_lora_batch() -> object | None:
    """The step's LoRA batch (which tokens run which adapter), or None: no step, or no adapter in it."""
    return None if _current is None else _current.lora
