"""The KV cache's host-RAM tier (`--kv-offloading-size GIB`, vLLM's flag) as a KV connector, both
halves, in front of the disk tier (`disk_tier.py`) when `--kv-cache-dir` is set too.

Save: when allocation is about to give a cached full block of the pool new content
(`BlockPool.on_evict`), the scheduler half gives the block a slot of the tier (a free one, else the
least recently used one's) and the worker half copies it there before the step's forward, which may
overwrite it. Load: when a request is admitted, the scheduler half walks its blocks past the pool's own
prefix hits through the tier until the first miss; those count as computed, and the worker half copies
them into the request's new blocks before the forward (they then join the pool's prefix cache and stay
in the tier too: evicted again, they need no copy). Then the disk tier is asked for the blocks after
those. A slot named by a step's load or save is not given away again in that step.

Keys: the pool's own (a block's key, its parent's key and its tokens, compared as a pool hit compares
them, so salts and LoRA adapters stay apart): the tier lives and dies with the engine, so it needs no
namespace. A block leaving the tier goes on to the disk tier when that is on and the block's file is not
there yet (the disk tier writes prompt blocks as they are computed, so that they outlive a restart and
reach other replicas at once; what it lacks are blocks of generated tokens and writes it dropped). Its
disk key is derived from the pool's chain of parents (`_disk_keys`); a block whose chain is gone (or a
LoRA request's) stays off the disk. With `--prefix-cache-hash builtin` (collisions can be crafted)
nothing is handed on: a disk file outlives the process, so it only takes keys that cannot collide.

The buffer is one tensor per cache tensor of N slots of one block, allocated at start; on CUDA in
pinned memory, every copy of a step on the tier's own stream (after the compute stream's work so far),
which the compute stream then waits for on the device: the host never waits for a save, and the
forward starts once the blocks it overwrites are out and the blocks it reads are in. The one host wait
is a hand-on to the disk tier, which waits for that slot's own earlier copy. On CPU the buffer is plain
memory and the copies are synchronous: the same bookkeeping, without a gain (the pool already is RAM;
BENCHMARKS.md, "The KV cache's disk tier").
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tokenmill.distributed import parallel_state
from tokenmill.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    cache_tensors,
)
from tokenmill.kv_transfer.block_files import StoredBlock
from tokenmill.kv_transfer.connector import BLOCK_DIM
from tokenmill.kv_transfer.disk_tier import (
    DiskTierMetadata,
    DiskTierOutput,
    DiskTierScheduler,
    DiskTierWorker,
    TierStats,
    block_layout,
    chain_key,
    disk_tier_scheduler,
    disk_tier_worker,
    shard_key,
)

TIER = "ram"


@dataclass
class HostEntry:
    """A block in the tier: its slot, the pool key of the block before it (or the salt), its tokens,
    and its disk-tier key and parent key when known (both tiers on)."""

    slot: int
    parent: object
    tokens: tuple[int, ...]
    disk: tuple[bytes, bytes] | None


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """The worker half's work in one step, in this order: `to_disk` (slot, disk key, disk parent key,
    tokens) handed on to the disk tier before the slot is reused; `offload` (block id, slot) evicted
    blocks into the buffer; `onload` (slot, block id) hits into the requests' blocks; `disk`: the disk
    tier's own work."""

    to_disk: list[tuple[int, bytes, bytes, tuple[int, ...]]] = field(default_factory=list)
    offload: list[tuple[int, int]] = field(default_factory=list)
    onload: list[tuple[int, int]] = field(default_factory=list)
    disk: DiskTierMetadata | None = None


@dataclass
class HostTierOutput(KVConnectorOutput):
    copy_in_seconds: float = 0.0
    copy_out_seconds: float = 0.0
    disk: DiskTierOutput | None = None


def _is_first(parent: object) -> bool:
    """Whether a pool block with this parent is a sequence's first (its parent is the salt; a LoRA
    request's first block chains from a key no block has, so its chain is never found)."""
    return parent is None or isinstance(parent, str)


class HostTierScheduler(KVConnectorScheduler):
    """`kv`: the engine's one-pool `KVCacheCoordinator`; `disk`: the disk tier's half, or None;
    `hand_on`: whether blocks leaving the tier may go to the disk tier."""

    def __init__(
        self, kv, num_slots: int, block_bytes: int, disk: DiskTierScheduler | None = None, hand_on: bool = True
    ) -> None:
        super().__init__()
        self.manager, self.bs, self.block_bytes = kv.managers[0], kv.block_size, block_bytes
        self.manager.pool.on_evict = self._evicted
        self.disk, self.hand_on = disk, hand_on and disk is not None
        self.ram_stats = TierStats(capacity_bytes=num_slots * block_bytes)
        self.entries: OrderedDict[object, HostEntry] = OrderedDict()  # pool key -> entry, least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._matched: dict[str, tuple[int, list[int]]] = {}  # request id -> (first block, slots it hit)
        self._pinned: set[int] = set()  # slots this step reads or writes (or a waiting request hit)
        self._to_disk: list[tuple[int, bytes, bytes, tuple[int, ...]]] = []
        self._offload: list[tuple[int, int]] = []
        self._onload: list[tuple[int, int]] = []
        self._memo: OrderedDict[object, tuple[bytes, bytes]] = OrderedDict()  # pool key -> disk keys
        self._memo_size = 2 * (self.manager.num_blocks + num_slots)

    def has_held(self) -> bool:
        return self.disk is not None and self.disk.has_held()

    def tier_stats(self) -> dict[str, dict]:
        self.ram_stats.usage_bytes = len(self.entries) * self.block_bytes
        return {TIER: dataclasses.asdict(self.ram_stats), **(self.disk.tier_stats() if self.disk else {})}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        slots: list[int] = []
        first = num_computed_tokens // self.bs
        if not request.params.needs_every_prompt_position:
            hits = []
            for key, parent, tokens in self.manager.block_chain(request, first, (request.num_tokens - 1) // self.bs):
                entry = self.entries.get(key)
                if entry is None or entry.parent != parent or entry.tokens != tokens:
                    break
                hits.append(key)
                slots.append(entry.slot)
            for key in reversed(hits):  # the head most recently used: a prefix's tail leaves first
                self.entries.move_to_end(key)
            self._pinned.update(slots)
        self._matched[request.request_id] = (first, slots)
        ram_tokens = len(slots) * self.bs
        disk_tokens = (
            self.disk.get_num_new_matched_tokens(request, num_computed_tokens + ram_tokens) if self.disk else 0
        )
        return ram_tokens + disk_tokens

    def update_state_after_alloc(self, request, blocks, num_computed_tokens: int, num_external_tokens: int) -> None:
        first, slots = self._matched.pop(request.request_id, (0, []))
        s = self.ram_stats
        if not request.params.needs_every_prompt_position:
            s.queries += request.num_tokens - num_computed_tokens
        ram_tokens = len(slots) * self.bs if num_external_tokens else 0
        if ram_tokens:
            self._onload += [(slot, blocks[0][i]) for i, slot in enumerate(slots, first)]
            s.hits += ram_tokens
            s.loads += 1
            s.load_bytes += len(slots) * self.block_bytes
        if self.disk is not None:
            self.disk.update_state_after_alloc(
                request, blocks, num_computed_tokens + ram_tokens, num_external_tokens - ram_tokens
            )

    def _evicted(self, block) -> None:
        """The pool is about to reuse `block` (a cached full block): keep it here."""
        entry = self.entries.get(block.key)
        if entry is not None:  # loaded from here before: the copy is still here (or, after a
            self.entries.move_to_end(block.key)  # --prefix-cache-hash builtin collision, kept: a miss later)
            return
        disk = self._disk_keys(block.key, block.parent, block.token_ids) if self.hand_on else None
        slot = self._take_slot()
        if slot is None:  # every slot is busy this step: the block is gone
            self.ram_stats.dropped_blocks += 1
            return
        self.entries[block.key] = HostEntry(slot, block.parent, block.token_ids, disk)
        self._offload.append((block.block_id, slot))
        self._pinned.add(slot)
        self.ram_stats.saved_blocks += 1
        self.ram_stats.saved_bytes += self.block_bytes

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used entry's (handed on to the disk tier), or None."""
        if self._free:
            return self._free.pop()
        victim = next((key for key, entry in self.entries.items() if entry.slot not in self._pinned), None)
        if victim is None:
            return None
        entry = self.entries.pop(victim)
        self.ram_stats.evicted_blocks += 1
        if entry.disk is not None and self.disk.missing(entry.disk[0]):
            self._to_disk.append((entry.slot, *entry.disk, entry.tokens))
            self.disk.note_saving(entry.disk[0])
        return entry.slot

    def _disk_keys(self, key, parent, tokens) -> tuple[bytes, bytes] | None:
        """The disk tier's key and parent key of the pool block (`key`, `parent`, `tokens`), from the
        chain of its parents in the pool or this tier, or None if a link is gone."""
        chain, known = [(key, parent, tokens)], None
        while not _is_first(parent):
            entry = self.entries.get(parent)
            known = self._memo.get(parent) or (entry.disk if entry is not None else None)
            if known is not None:
                break
            block = self.manager.pool.cached.get(parent)
            if block is None:
                return None
            chain.append((block.key, block.parent, block.token_ids))
            parent = block.parent
        disk_parent = self.disk.namespace if known is None else known[0]
        for k, p, t in reversed(chain):
            keys = (chain_key(disk_parent, t, p if _is_first(p) else None), disk_parent)
            self._memo[k] = keys
            self._memo.move_to_end(k)
            disk_parent = keys[0]
        while len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return keys

    def build_connector_meta(self, sched, requests) -> HostTierMetadata | None:
        meta = HostTierMetadata(self._to_disk, self._offload, self._onload)
        if self.disk is not None:
            meta.disk = self.disk.build_connector_meta(sched, requests)
        self._to_disk, self._offload, self._onload = [], [], []
        self._pinned = {slot for _, slots in self._matched.values() for slot in slots}  # still waiting for room
        return meta if meta.to_disk or meta.offload or meta.onload or meta.disk is not None else None

    def update_connector_output(self, output: HostTierOutput | None):
        if output is None:
            return [], {}
        self.ram_stats.load_seconds += output.copy_in_seconds
        self.ram_stats.save_seconds += output.copy_out_seconds
        return self.disk.update_connector_output(output.disk) if self.disk else ([], {})

    def request_finished(self, request) -> bool:
        self._matched.pop(request.request_id, None)
        return self.disk.request_finished(request) if self.disk else False

    def step_failed(self, meta: HostTierMetadata) -> list[str]:
        """A step that raised may not have copied its evicted blocks, nor handed blocks to the disk
        writer: forget both."""
        lost = {slot for _, slot in meta.offload}
        for key in [k for k, e in self.entries.items() if e.slot in lost]:
            self._free.append(self.entries.pop(key).slot)
        if self.disk is None:
            return []
        self.disk.forget_saving(key for _, key, _, _ in meta.to_disk)
        return self.disk.step_failed(meta.disk) if meta.disk is not None else []


class HostBuffer:
    """`num_slots` blocks of every cache tensor in host memory (pinned on CUDA), and the copies between
    them and the cache (on CUDA on a stream of their own)."""

    def __init__(self, tensors: list[tuple[torch.Tensor, int]], num_slots: int, device: torch.device) -> None:
        self.tensors = [t for t, _ in tensors]
        cuda = device.type == "cuda"
        self.slots = [torch.empty((num_slots, *shape), dtype=dtype) for shape, dtype in block_layout(tensors)]
        if cuda:  # pinned in place: the pinned allocator would round each buffer up to a power of two bytes
            for slots in self.slots:
                error = int(torch.cuda.cudart().cudaHostRegister(slots.data_ptr(), slots.nbytes, 0))
                if error:
                    raise RuntimeError(f"--kv-offloading-size: pinning {slots.nbytes} bytes failed (cudaError {error})")
        self.pinned = cuda
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.events: dict[int, torch.cuda.Event] = {}  # slot -> the event after its latest copy in

    def copy(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """`out`: (block id, slot) pairs, evicted blocks into their slots; else (slot, block id) pairs,
        hits into the requests' blocks."""
        if not pairs:
            return
        if self.stream is None:
            self._copy(pairs, out, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)  # the blocks' last writes land before they are copied out
        with torch.cuda.stream(self.stream):
            self._copy(pairs, out, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        if out:
            for _, slot in pairs:
                self.events[slot] = done
        compute.wait_stream(self.stream)  # on the device: the forward runs once these copies are done

    def _copy(self, pairs: list[tuple[int, int]], out: bool, non_blocking: bool) -> None:
        for a, b in pairs:
            block, slot = (a, b) if out else (b, a)
            for cache, slots in zip(self.tensors, self.slots):
                in_cache, in_slot = cache.select(BLOCK_DIM, block), slots[slot]
                if out:
                    in_slot.copy_(in_cache, non_blocking=non_blocking)
                else:
                    in_cache.copy_(in_slot, non_blocking=non_blocking)

    def close(self) -> None:
        """Unpin the buffer (after the copies on the tier's stream are done)."""
        if self.pinned:
            self.stream.synchronize()
            for slots in self.slots:
                torch.cuda.cudart().cudaHostUnregister(slots.data_ptr())
            self.pinned = False

    def read(self, slot: int) -> list[torch.Tensor]:
        """A copy of a slot's block (for the disk writer), once the slot's own copy in has landed."""
        event = self.events.pop(slot, None)
        if event is not None:
            event.synchronize()
        return [slots[slot].clone() for slots in self.slots]


class HostTierWorker(KVConnectorWorker):
    """The tier's copies around each step, then the disk tier's worker half (`disk`, or None); `rank`:
    this worker's tensor-parallel rank (its share of each block; the disk keys it writes under)."""

    def __init__(self, buffer: HostBuffer, disk: DiskTierWorker | None = None, rank: int = 0) -> None:
        self.buffer, self.disk, self.rank = buffer, disk, rank
        self._copy_in = self._copy_out = 0.0

    def start_load_kv(self, meta: HostTierMetadata) -> None:
        start = time.perf_counter()
        if meta.to_disk:  # before the slots are written again below
            self.disk.writer.put(
                [
                    StoredBlock(shard_key(key, self.rank), shard_key(parent, self.rank), tokens, self.buffer.read(slot))
                    for slot, key, parent, tokens in meta.to_disk
                ]
            )
        self.buffer.copy(meta.offload, out=True)
        middle = time.perf_counter()
        self.buffer.copy(meta.onload, out=False)
        self._copy_out, self._copy_in = middle - start, time.perf_counter() - middle
        if meta.disk is not None:
            self.disk.start_load_kv(meta.disk)

    def wait_for_save(self, meta: HostTierMetadata) -> None:
        if meta.disk is not None:
            self.disk.wait_for_save(meta.disk)

    def get_finished(self, idle: bool) -> HostTierOutput:
        disk = self.disk.get_finished(idle) if self.disk is not None else None
        return HostTierOutput(self._copy_in, self._copy_out, disk)

    def close(self) -> None:
        self.buffer.close()
        if self.disk is not None:
            self.disk.close()


def _slots(config, layout) -> tuple[int, int]:
    """How many blocks `--kv-offloading-size` holds, and one block's bytes (on one rank)."""
    block_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in layout)
    num_slots = int(config.cache.kv_offloading_size_gib * (1 << 30)) // block_bytes
    if num_slots < 1:
        raise ValueError(
            f"--kv-offloading-size {config.cache.kv_offloading_size_gib:g} GiB holds no KV block "
            f"(one takes {block_bytes} bytes)"
        )
    return num_slots, block_bytes


def host_tier_scheduler(config, kv, executor) -> HostTierScheduler:
    """The scheduler half for `--kv-offloading-size`, with the disk tier's behind it if
    `--kv-cache-dir` is set; refuses (naming the flags) a model with more than one KV pool."""
    if len(kv.managers) > 1:
        raise ValueError(
            "--kv-offloading-size needs a model whose layers share one KV pool (no sliding-window "
            "layers); --kv-cache-dir alone works with sliding windows"
        )
    num_slots, block_bytes = _slots(config, block_layout(cache_tensors(executor.runner)))
    disk = disk_tier_scheduler(config, kv, executor) if config.cache.kv_cache_dir is not None else None
    return HostTierScheduler(kv, num_slots, block_bytes, disk, hand_on=config.cache.prefix_cache_hash != "builtin")


def host_tier_worker(config, runner) -> HostTierWorker:
    """The worker half over `runner`'s caches (on each tensor-parallel rank, its own share)."""
    tensors = cache_tensors(runner)
    buffer = HostBuffer(tensors, _slots(config, block_layout(tensors))[0], runner.device)
    disk = disk_tier_worker(config, runner) if config.cache.kv_cache_dir is not None else None
    return HostTierWorker(buffer, disk, parallel_state.tp_rank())
