"""This process's place in its engine's tensor-parallel group, and the collectives the layers call.

One engine with `tensor_parallel_size` N runs N processes, rank 0 the driver (in the engine core's
process) and ranks 1..N-1 workers (`tokenmill.executor.worker_process`), joined in one
torch.distributed group: gloo on CPU, NCCL on CUDA, rendezvous over TCP on 127.0.0.1. Layers built while a group is
set up take their rank and size from here; with none (the default) they hold whole weights and call
no collective.

With `pipeline_parallel_size` P the world is N * P ranks: stage s holds global ranks s*N .. s*N+N-1,
its own tensor-parallel sub-group (the layers' collectives run in it), and the decoder layers
`pp_layers` gives it; consecutive stages pass the hidden state point to point (`send` / `recv`).

With context parallelism (`cp_size` N > 1) the world is one group of N ranks that stripe each
sequence's KV cache by token (`tokenmill.attention.context_parallel`): N ranks of whole weights
(tensor-parallel size 1), or the N tensor-parallel ranks themselves; `cp_all_gather` and
`cp_all_to_all` run in it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time

import torch
import torch.distributed as dist

_rank, _size = 0, 1
_pp_rank, _pp_size = 0, 1
_tp_group: dist.ProcessGroup | None = None  # this stage's tensor-parallel group (None: the whole world)
_partition: tuple[int, ...] = ()  # decoder layers per pipeline stage (empty: an even split)
_device = torch.device("cpu")
_cp_rank, _cp_size = 0, 1  # this rank's place in the context-parallel group (the whole world)

# The rendezvous and every collective give up after this long. A rank that died is noticed sooner:
# its connection closes (the collective fails at once) and the driver watches the worker processes
# while it waits at the rendezvous (`worker_process.join_and_load`). So this only ends a wait on a rank
# that is alive but slow — one still loading large weights on a busy machine while the others wait in
# their first collective — and is long for that; TOKENMILL_DIST_TIMEOUT (seconds) sets it.
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("TOKENMILL_DIST_TIMEOUT", 1800)))


def init_model_parallel(
    rank: int,
    tp: int,
    pp: int,
    init_method: str,
    device: torch.device,
    partition: tuple[int, ...] = (),
    cp: int = 1,
) -> None:
    """Join a world of tp * pp ranks (global `rank`), and its tensor-parallel group per pipeline stage;
    with `cp` > 1 (no pipeline) a world of max(tp, cp) ranks, all one context-parallel group."""
    global _rank, _size, _pp_rank, _pp_size, _tp_group, _partition, _device, _cp_rank, _cp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = max(tp * pp, cp)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    _cp_rank, _cp_size = (rank, cp) if cp > 1 else (0, 1)
    if pp > 1:  # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=TIMEOUT) for s in range(pp)]
        _tp_group = groups[rank // tp]
    _pp_rank, _rank = divmod(rank % (tp * pp), tp)  # context-parallel ranks of tp 1 are all tp rank 0
    _size, _pp_size, _partition, _device = tp, pp, tuple(partition), device


def destroy_tensor_parallel() -> None:
    global _rank, _size, _pp_rank, _pp_size, _tp_group, _partition, _cp_rank, _cp_size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _pp_rank, _pp_size, _tp_group, _partition, _cp_rank, _cp_size = 0, 1, 0, 1, None, (), 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def pp_rank() -> int:
    return _pp_rank


def pp_size() -> int:
    return _pp_size


def cp_rank() -> int:
    return _cp_rank


def cp_size() -> int:
    return _cp_size


def cp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every context-parallel rank's `x` (same shape on all), stacked in rank order: [cp_size, *x.shape]."""
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_cp_size)]
    dist.all_gather(parts, x.contiguous())
    stats.add("cp_all_gather", start, x.numel() * x.element_size())
    return torch.stack(parts)


def cp_all_to_all(x: torch.Tensor) -> torch.Tensor:
    """x[r] goes to context-parallel rank r; returns what each rank sent here, in rank order."""
    start = time.perf_counter()
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    stats.add("cp_all_to_all", start, x.numel() * x.element_size())
    return out


def tp_group() -> dist.ProcessGroup | None:
    """This stage's tensor-parallel group (None: the default group, the whole world)."""
    return _tp_group


def global_rank(stage: int, tp_index: int = 0) -> int:
    """The world rank of tensor-parallel rank `tp_index` of pipeline stage `stage`."""
    return stage * _size + tp_index


def pp_layers(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage holds (all of them without pipelining)."""
    counts = layer_partition(num_layers, _pp_size, _partition)
    start = sum(counts[:_pp_rank])
    return start, start + counts[_pp_rank]


def layer_partition(num_layers: int, stages: int, partition: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: `partition`, else an even split (an error naming the option
    when the layers do not fit)."""
    if not partition and num_layers % stages:
        raise ValueError(
            f"--pipeline-parallel-size {stages} does not divide the model's {num_layers} decoder "
            "layers; give the layers per stage with --pipeline-layer-partition"
        )
    counts = partition or (num_layers // stages,) * stages
    if sum(counts) != num_layers:
        raise ValueError(
            f"--pipeline-layer-partition {','.join(map(str, counts))} sums to {sum(counts)}, "
            f"but the model has {num_layers} decoder layers"
        )
    return counts


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
    dist.all_reduce(x, group=_tp_group)
    stats.add("all_reduce", start, x.numel() * x.element_size())
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on all) concatenated along the last dimension, in rank order."""
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    stats.add("all_gather", start, x.numel() * x.element_size())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """The driver's `obj` on every rank of its tensor-parallel group (pickled; the workers pass nothing)."""
    start = time.perf_counter()
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(_pp_rank), group=_tp_group)
    stats.add("broadcast", start, 0)
    return box[0]


def send(obj: object, tensors: list[torch.Tensor], dst: int) -> list:
    """Start sending `obj` (pickled) and `tensors` to world rank `dst`, which takes them with `recv`;
    returns the pending sends (wait on them, or keep them until done: their buffers must live)."""
    start = time.perf_counter()
    data = pickle.dumps((obj, [(t.shape, t.dtype) for t in tensors]))
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device)
    parts = [torch.tensor([len(data)], dtype=torch.int64, device=_device), payload, *(t.contiguous() for t in tensors)]
    works = [(dist.isend(part, dst), part) for part in parts]
    stats.add("send", start, sum(t.numel() * t.element_size() for t in tensors))
    stats.add("send_object", start, len(data))
    return works


def recv(src: int) -> tuple[object, list[torch.Tensor]]:
    """What world rank `src` sent with `send`: the object and the tensors (waits for them)."""
    start = time.perf_counter()
    size = torch.empty(1, dtype=torch.int64, device=_device)
    dist.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=_device)
    dist.recv(payload, src)
    obj, specs = pickle.loads(payload.cpu().numpy().tobytes())
    tensors = [torch.empty(shape, dtype=dtype, device=_device) for shape, dtype in specs]
    for t in tensors:
        dist.recv(t, src)
    stats.add("recv", start, 0)
    return obj, tensors
