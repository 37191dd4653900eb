"""The KV cache's disk tier (`--kv-cache-dir PATH`, `--kv-disk-size GIB`) as a KV connector, both halves.

Save: in the step that completes a prompt, the scheduler half names the prompt's full blocks that are
not on disk yet; right after the forward pass the worker half copies them out of the cache (the only
part of a save the step loop waits for) and hands them to a `BlockWriter`, which writes them on its own
thread (`block_files.py`). Blocks are written as their prompt is computed, not when the pool evicts
them, so they outlive a restart or a crash of this server and are there for other servers on the same
directory at once. A sliding-window model's window pools return a prompt's early blocks while its
later chunks are computed, so there each block is named in the step that fills it, while every pool
still holds it (a file holds the block of every pool); the files' times are set as if the prompt had
been written at once, tail first, so eviction still takes a prefix's tail before its head.

Load: when a request is admitted, the scheduler half looks up its prompt's blocks past the pool's own
prefix hits, block by block until the first miss, reading and verifying each file. A run of hits
shorter than `--kv-disk-min-load-tokens` is recomputed instead (loading a few blocks costs about as
much as computing them); a longer one counts as computed, and the worker half writes the blocks into
the request's own blocks before the step's forward. Files are read by the scheduler half, not the
worker, so a file that turns out bad is a miss before the request counts its tokens.

Keys: a block's key chains the key of the block before it with its tokens; the first block chains
from the engine's namespace (model architecture, a digest of the weight files, weight format,
compute dtype, the cache layout — KV dtype, block size, layers and heads — and the parallel layout)
and the request's `cache_salt`. So a block is found only by an engine that would have computed the same
KV for the same prefix.

Tensor parallelism: each rank holds its share of every block (its heads), so each rank's worker half
writes and loads a file of its own, under its own key (`shard_key`: rank 0's is the block's key). The
scheduler half, in the driver, reads every rank's file of a block before it counts the block as a
hit (a block is a hit only when every rank's share is there and sound) and sends all shares along;
each rank copies in its own. Context parallelism is the same with a rank's stripe of a block's tokens
for its share (`shard_rank`); the namespace holds the context-parallel size.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.distributed import parallel_state
from tokenmill.kv_transfer.base import (
    BlockTable,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    cache_tensors,
)
from tokenmill.kv_transfer.block_files import (
    BadBlockFile,
    BlockLayout,
    BlockWriter,
    StoredBlock,
    WriterStats,
    block_path,
    read_block,
    remove,
)
from tokenmill.kv_transfer.connector import BLOCK_DIM

logger = logging.getLogger(__name__)

TIER = "disk"


@dataclass
class TierStats:
    """The tier's counters for /metrics (`tokenmill:kv_tier_*{tier="disk"}`), cumulative. Lookups are
    in prompt tokens past the pool's hits; a request whose hit is loaded counts a load, one whose hit
    was too short to pay counts a recompute."""

    queries: int = 0  # prompt tokens looked up (past the pool's prefix hits)
    hits: int = 0  # of which found on disk and loaded
    loads: int = 0  # requests that loaded a hit
    recomputes: int = 0  # requests whose hit was shorter than --kv-disk-min-load-tokens
    load_bytes: int = 0
    load_seconds: float = 0.0  # reading and verifying files (scheduler) + copying into the cache (worker)
    bad_files: int = 0  # truncated, corrupt or foreign files found (and removed)
    saved_blocks: int = 0  # written by this engine
    saved_bytes: int = 0
    save_seconds: float = 0.0  # the step loop's share of saving: copying blocks out of the cache
    write_seconds: float = 0.0  # the writer thread's
    dropped_blocks: int = 0  # not written: the queue was full or writing is off
    evicted_blocks: int = 0
    errors: int = 0  # writes that failed (writing turned off)
    usage_bytes: int = 0  # the directory's block files, as last counted
    capacity_bytes: int = 0


def weights_digest(source, cache_dir: Path) -> str:
    """BLAKE2b of the model's weight files (and config.json of an HF directory), remembered in
    `cache_dir` by path, size and modification time, so a restart does not hash them again."""
    root = Path(source.path)
    files = (
        [root]
        if root.is_file()
        else sorted(
            p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") or p.name == "config.json"
        )
    )
    stamp = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    memo = cache_dir / "weights" / f"{hashlib.sha256(stamp.encode()).hexdigest()}.txt"
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b(digest_size=32)
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 23):
                h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def tier_namespace(config, executor, layout: BlockLayout, cache_dir: Path) -> bytes:
    """What a block's key chains from: every setting that changes the KV a prefix computes to."""
    identity = {
        "format": 1,
        "architecture": executor.model_config.architecture,
        "weights": weights_digest(executor.source, cache_dir),
        "quantization": executor.quantization,
        "dtype": str(executor.dtype),
        "layout": [[list(shape), str(dtype)] for shape, dtype in layout],
        "block_size": config.cache.block_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
    }
    if config.parallel.context_parallel_size > 1:  # only then: one process's files keep their keys
        identity["context_parallel_size"] = config.parallel.context_parallel_size
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def chain_key(parent: bytes, token_ids, salt: str | None = None) -> bytes:
    """A block's key from its parent's (the namespace for the first block, with the salt) and tokens."""
    h = hashlib.sha256(parent)
    if salt is not None:
        h.update(b"salt:" + len(salt.encode()).to_bytes(4, "little") + salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def shard_key(key: bytes, rank: int) -> bytes:
    """Rank `rank`'s key for its share of the block keyed `key` (rank 0: the same)."""
    return key if rank == 0 else hashlib.sha256(key + b"tp-rank:" + rank.to_bytes(4, "little")).digest()


def shard_rank() -> int:
    """This worker's share of each block: its context-parallel rank (its stripe of the tokens; with
    tensor parallelism sharing the ranks, the same number), else its tensor-parallel rank (its heads)."""
    return parallel_state.cp_rank() if parallel_state.cp_size() > 1 else parallel_state.tp_rank()


def block_layout(tensors: list[tuple[torch.Tensor, int]]) -> BlockLayout:
    """The shape and dtype of one block's slice of each cache tensor."""
    return [(tuple(n for d, n in enumerate(t.shape) if d != BLOCK_DIM), t.dtype) for t, _ in tensors]


@dataclass
class DiskTierMetadata(KVConnectorMetadata):
    """`load`: (block table, first block, each block's cache tensor slices per tensor-parallel rank) to
    write before the forward; `save`: (block table, blocks to save as (index, key, parent key, tokens,
    file mtime)) to copy out after it."""

    load: list[tuple[BlockTable, int, list[list[list[torch.Tensor]]]]] = field(default_factory=list)
    save: list[tuple[BlockTable, list[tuple[int, bytes, bytes, list[int], float]]]] = field(default_factory=list)


@dataclass
class DiskTierOutput(KVConnectorOutput):
    """The worker half's report: the writer's counters and seconds it spent copying in and out."""

    writer: WriterStats
    copy_in_seconds: float = 0.0
    copy_out_seconds: float = 0.0


class DiskTierScheduler(KVConnectorScheduler):
    """`kv`: the engine's `KVCacheCoordinator`; `layout`: one block's slice of each cache tensor (on
    every one of the `ranks` tensor- or context-parallel ranks)."""

    def __init__(
        self,
        directory: Path,
        namespace: bytes,
        kv,
        layout: BlockLayout,
        min_load_tokens: int,
        capacity: int,
        ranks: int = 1,
        windowed: bool = False,
    ):
        super().__init__()
        self.ranks, self.windowed = ranks, windowed
        self.directory, self.namespace, self.kv, self.layout = directory, namespace, kv, layout
        self.bs, self.min_load_tokens = kv.block_size, min_load_tokens
        self.disk_stats = TierStats(capacity_bytes=capacity)
        self._keys: dict[str, list[bytes]] = {}  # request id -> chained keys of its prompt's full blocks
        # admitted lookups: first block, each block's tensors per rank
        self._found: dict[str, tuple[int, list[list[list[torch.Tensor]]]]] = {}
        self._loaded: dict[str, range] = {}  # request id -> blocks it took from disk (not saved again)
        # request id -> (its prompt blocks before this one were named to save, when the first were)
        self._named: dict[str, tuple[int, float]] = {}
        self._named_before: dict[str, tuple[int, float] | None] = {}  # as it was before the last step named
        self._saving: set[bytes] = set()  # keys handed to the writer, not reported written yet
        self._load: list[tuple[BlockTable, int, list[list[list[torch.Tensor]]]]] = []

    def has_held(self) -> bool:
        """Blocks are being written: the engine keeps stepping (idle steps wait on the writer a little)
        until the worker half has reported them, so /metrics counts every write."""
        return bool(self._saving)

    def tier_stats(self) -> dict[str, dict]:
        return {TIER: dataclasses.asdict(self.disk_stats)}

    def prompt_keys(self, request) -> list[bytes]:
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys, parent, bs, tokens = [], self.namespace, self.bs, request.prompt_token_ids
            for i in range(len(tokens) // bs):
                parent = chain_key(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt if i == 0 else None)
                keys.append(parent)
            self._keys[request.request_id] = keys
        return keys

    def missing(self, key: bytes) -> bool:
        """Whether some rank's file of the block keyed `key` is not on disk (nor being written)."""
        return key not in self._saving and not all(path.exists() for path in self._paths(key))

    def note_saving(self, key: bytes) -> None:
        """A block keyed `key` was handed to the writer by another tier (the engine waits for its report)."""
        self._saving.add(key)

    def forget_saving(self, keys) -> None:
        """Blocks named to save in a step that raised: they may never reach the writer, so the engine
        stops waiting for them (a later prompt with them names them again)."""
        self._saving.difference_update(keys)

    def _parent(self, keys: list[bytes], i: int) -> bytes:
        return keys[i - 1] if i else self.namespace

    def _paths(self, key: bytes) -> list[Path]:
        """The files of every rank's share of the block keyed `key`."""
        return [block_path(self.directory, shard_key(key, r)) for r in range(self.ranks)]

    def _read(self, request, keys: list[bytes], i: int) -> list[list[torch.Tensor]] | None:
        """Block `i`'s tensors on each rank, or None (a miss) unless every rank's file is there and sound."""
        shares, tokens = [], request.prompt_token_ids[i * self.bs : (i + 1) * self.bs]
        for r, path in enumerate(self._paths(keys[i])):
            try:
                key, parent = shard_key(keys[i], r), shard_key(self._parent(keys, i), r)
                shares.append(read_block(path, key, parent, tokens, self.layout))
            except FileNotFoundError:
                return None
            except (BadBlockFile, OSError, ValueError, KeyError, TypeError) as e:  # any unreadable file: a miss
                logger.warning("KV disk tier: %s is not a usable block (%s): removed, a miss", path.name, e)
                self.disk_stats.bad_files += 1
                remove(path)
                return None
        return shares

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        rid = request.request_id
        if request.params.prompt_logprobs is not None or request.lora_id:  # it computes every prompt position,
            return 0  # or under a LoRA adapter (its K/V are not the base model's; a load id is no key)
        first = num_computed_tokens // self.bs
        found = self._found.get(rid)
        if found is not None and found[0] == first:  # looked up before (its blocks did not fit then)
            return len(found[1]) * self.bs
        self._found.pop(rid, None)
        keys = self.prompt_keys(request)
        end = (request.num_prompt_tokens - 1) // self.bs  # the last prompt token is always computed
        if end <= first:
            return 0
        start, blocks = time.perf_counter(), []
        for i in range(first, end):
            block = self._read(request, keys, i)
            if block is None:
                break
            blocks.append(block)
        for i in reversed(range(first, first + len(blocks))):  # the head most recently used: evicted last
            for path in self._paths(keys[i]):
                try:
                    os.utime(path)
                except OSError:
                    pass
        s = self.disk_stats
        s.queries += request.num_prompt_tokens - num_computed_tokens
        if len(blocks) * self.bs < self.min_load_tokens:
            s.recomputes += bool(blocks)
            self._found[rid] = (first, [])  # asked again while it waits for room: the same answer
            return 0
        s.hits += len(blocks) * self.bs
        s.loads += 1
        s.load_bytes += sum(t.nbytes for block in blocks for share in block for t in share)
        s.load_seconds += time.perf_counter() - start
        self._found[rid] = (first, blocks)
        return len(blocks) * self.bs

    def update_state_after_alloc(
        self, request, blocks: BlockTable, num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        found = self._found.pop(request.request_id, None)
        if found is None or not num_external_tokens:
            return
        first, loaded = found
        self._load.append(([list(t) for t in blocks], first, loaded))
        self._loaded[request.request_id] = range(first, first + len(loaded))

    def build_connector_meta(self, sched, requests) -> DiskTierMetadata | None:
        meta = DiskTierMetadata(load=self._load)
        self._load, self._named_before = [], {}
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.lora_id or request.num_computed_tokens >= request.num_prompt_tokens:
                continue
            if not self.windowed and request.num_computed_tokens + num_new < request.num_prompt_tokens:
                continue  # its blocks stay in the pool until the prompt is done: named then, all at once
            keys, loaded, bs = self.prompt_keys(request), self._loaded.get(rid, range(0)), self.bs
            self._named_before[rid] = self._named.get(rid)
            first, stamp = self._named.get(rid, (0, time.time()))
            done = min(request.num_computed_tokens + num_new, len(keys) * bs) // bs
            self._named[rid] = (max(first, done), stamp)
            todo = [  # the files' times as if the whole prompt were written at once, its tail first
                (i, keys[i], self._parent(keys, i), request.prompt_token_ids[i * bs : (i + 1) * bs], stamp - i * 1e-5)
                for i in range(first, done)
                if i not in loaded
                and keys[i] not in self._saving
                and self.kv.holds_block(rid, i)
                and not all(path.exists() for path in self._paths(keys[i]))
            ]
            if todo:
                meta.save.append(([list(t) for t in self.kv.block_ids(rid)], todo))
                self._saving.update(key for _, key, _, _, _ in todo)
        # while blocks are being written the worker half reports on them after every step
        return meta if meta.load or meta.save or self._saving else None

    def update_connector_output(self, output: DiskTierOutput | None):
        if output is not None:
            w, s = output.writer, self.disk_stats
            self._saving.difference_update(w.written_keys)
            s.saved_blocks, s.saved_bytes, s.write_seconds = w.blocks, w.bytes, w.seconds
            s.dropped_blocks, s.evicted_blocks, s.errors, s.usage_bytes = w.dropped, w.evicted, w.errors, w.usage_bytes
            s.save_seconds += output.copy_out_seconds
            s.load_seconds += output.copy_in_seconds
        return [], {}

    def step_failed(self, meta: DiskTierMetadata) -> list[str]:
        """The step (the last one built: the tier runs without a pipeline's batch queue) may not have
        saved what it named: those blocks are named again when its requests run again."""
        self.forget_saving(key for _, todo in meta.save for _, key, _, _, _ in todo)
        for rid, before in self._named_before.items():
            if rid in self._named:
                if before is None:
                    del self._named[rid]
                else:
                    self._named[rid] = before
        return []

    def request_finished(self, request) -> bool:
        rid = request.request_id
        self._keys.pop(rid, None)
        self._found.pop(rid, None)
        self._loaded.pop(rid, None)
        self._named.pop(rid, None)
        return False


class DiskTierWorker(KVConnectorWorker):
    """`tensors`: every cache tensor with the pool its blocks come from; `rank`: this worker's
    `shard_rank` (the share of each block it copies, and the keys it writes under)."""

    def __init__(self, writer: BlockWriter, tensors: list[tuple[torch.Tensor, int]], rank: int = 0) -> None:
        self.writer, self.tensors, self.rank = writer, tensors, rank
        self._copy_in = self._copy_out = 0.0
        atexit.register(self.close)  # what is queued is written before the process ends

    def start_load_kv(self, meta: DiskTierMetadata) -> None:
        start = time.perf_counter()
        for tables, first, blocks in meta.load:
            for i, block in enumerate(blocks, first):
                for (t, pool), saved in zip(self.tensors, block[self.rank]):
                    t.select(BLOCK_DIM, tables[pool][i]).copy_(saved)
        self._copy_in = time.perf_counter() - start if meta.load else 0.0

    def wait_for_save(self, meta: DiskTierMetadata) -> None:
        start = time.perf_counter()
        for tables, todo in meta.save:
            self.writer.put(
                [
                    StoredBlock(
                        shard_key(key, self.rank),
                        shard_key(parent, self.rank),
                        tokens,
                        [
                            t.select(BLOCK_DIM, tables[pool][i]).to(
                                "cpu", copy=True, memory_format=torch.contiguous_format
                            )
                            for t, pool in self.tensors
                        ],
                        mtime,
                    )
                    for i, key, parent, tokens, mtime in reversed(todo)
                ]
            )
        self._copy_out = time.perf_counter() - start if meta.save else 0.0

    def get_finished(self, idle: bool) -> DiskTierOutput:
        if idle:  # the step ran nothing: the engine waits for writes to report, so wait for them here
            self.writer.flush(timeout=0.05)
        return DiskTierOutput(self.writer.report(), self._copy_in, self._copy_out)

    def close(self) -> None:
        self.writer.close()


def _directory(config) -> Path:
    directory = Path(config.cache.kv_cache_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _capacity(config) -> int:
    return int(config.cache.kv_disk_size_gib * (1 << 30))


def disk_tier_scheduler(config, kv, executor) -> DiskTierScheduler:
    """The scheduler half for `config.cache.kv_cache_dir`, over `executor`'s model and cache layout."""
    directory, layout = _directory(config), block_layout(cache_tensors(executor.runner))
    namespace = tier_namespace(config, executor, layout, directory)
    return DiskTierScheduler(
        directory,
        namespace,
        kv,
        layout,
        config.cache.kv_disk_min_load_tokens,
        _capacity(config),
        max(config.parallel.tensor_parallel_size, config.parallel.context_parallel_size),
        any(window is not None for window in executor.runner.kv_cache_config.pool_windows),
    )


def disk_tier_worker(config, runner) -> DiskTierWorker:
    """The worker half over `runner`'s caches: on each rank, its own share."""
    tensors = cache_tensors(runner)
    return DiskTierWorker(BlockWriter(_directory(config), _capacity(config)), tensors, shard_rank())
