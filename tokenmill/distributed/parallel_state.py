"""This process's place in its engine's tensor-parallel group, and the collectives the layers call.

One engine with `tensor_parallel_size` N runs N processes, rank 0 the driver (in the engine core's
process) and ranks 1..N-1 workers (`tokenmill.executor.multiproc`), joined in one torch.distributed
group: gloo on CPU, NCCL on CUDA, rendezvous over TCP on 127.0.0.1. Layers built while a group is
set up take their rank and size from here; with none (the default) they hold whole weights and call
no collective.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

_rank, _size = 0, 1

# a collective whose peer died fails after this long instead of waiting forever
TIMEOUT = datetime.timedelta(seconds=60)


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the group (`init_method`: "tcp://127.0.0.1:PORT", the same for every rank)."""
    global _rank, _size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
    _rank, _size = rank, size


def destroy_tensor_parallel() -> None:
    global _rank, _size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size = 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


class CommStats:
    """Collectives this process ran: calls, seconds spent in them and payload bytes, per kind
    (`tokenmill.distributed.parallel_state.stats`; the tensor-parallel benchmark reads them)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, start: float, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


stats = CommStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the default group's ranks, in place (every rank gets the same bits)."""
    start = time.perf_counter()
    dist.all_reduce(x)
    stats.add("all_reduce", start, x.numel() * x.element_size())
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on all) concatenated along the last dimension, in rank order."""
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    stats.add("all_gather", start, x.numel() * x.element_size())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """The driver's `obj` on every rank (pickled; the workers pass nothing)."""
    start = time.perf_counter()
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    stats.add("broadcast", start, 0)
    return box[0]
