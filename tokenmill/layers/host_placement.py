"""Weights built in host memory beside a CUDA device (`worker/offload.py` plans which): the decoder
layers that --cpu-offload-gb streams and the routed experts that --cpu-moe / --n-cpu-moe run on the
CPU. The loader builds the model inside `placing(HostPlacement(...))`; `models.utils.decoder_layers`
and `FusedMoE` then allocate those weights under `torch.device("cpu")`, so they are loaded straight
into host memory and never held by the device: a model larger than the GPU can start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostPlacement:
    layers: frozenset[int] = frozenset()  # decoder layers streamed from the host
    experts: frozenset[int] = frozenset()  # decoder layers whose routed experts run on the host


NOTHING = HostPlacement()  # every weight on the device
_CURRENT: ContextVar[HostPlacement] = ContextVar("host_placement", default=NOTHING)  # noqa: B039 (frozen)


@contextlib.contextmanager
def placing(placement: HostPlacement) -> Iterator[None]:
    """Models built inside this follow `placement`."""
    token = _CURRENT.set(placement)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> HostPlacement:
    return _CURRENT.get()


def on_host(host: bool):
    """A context allocating in host memory when `host`, else on the device the model is built on."""
    return torch.device("cpu") if host else contextlib.nullcontext()
