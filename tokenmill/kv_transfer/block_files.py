"""The disk tier's files: one KV block per file, named by its prefix key, written atomically in the
background and verified on every read.

A file holds a magic tag, a JSON header (the block's key, its parent key, its token ids and the shape
and dtype of each cache tensor's slice), the raw bytes of those slices, and a BLAKE2b checksum of
everything before it. A read checks the checksum, then that the header names exactly the block the
caller looks for (key, parent and tokens: a file copied in from another model, salt or prefix is
foreign) and that the slices have the engine's layout; any mismatch, a short file or an unreadable one
is a miss and the file is removed, so a bad file costs one recompute and never wrong KV.

Several engines may share a directory (replicas, restarts): a file appears under its name only when
complete (written to a unique temporary name, then renamed), a file that disappears between a lookup
and its read is a miss, and least-recently-used order across processes is the files' modification
times (a read touches its file). `BlockWriter` writes on its own thread from a bounded queue, so the
step loop only hands blocks over; when the queue is full the blocks are dropped (they are a cache). A
write that fails (disk full, a size limit smaller than one block) turns writing off with one log line:
requests go on without the tier, and reads still work.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"TMKVBLK1"
_CHECKSUM_BYTES = 16
SUFFIX = ".kv"
_STALE_TMP_SECONDS = 600.0  # a temporary file this old was left by a writer that died
_EVICT_TO = 0.9  # eviction frees room down to this fraction of the limit (not one file per write)

BlockLayout = list[tuple[tuple[int, ...], torch.dtype]]  # per cache tensor: one block's slice shape, dtype


@dataclass
class StoredBlock:
    """One block to write: its chained key, its parent's key, its tokens and its cache tensors' slices;
    `mtime`: the file's modification time, the order eviction goes by (a prompt's head newest, so its
    tail goes first), or None for the time it is written."""

    key: bytes
    parent: bytes
    token_ids: Sequence[int]
    tensors: list[torch.Tensor]
    mtime: float | None = None


class BadBlockFile(ValueError):
    """A file under a block's name that is not that block (truncated, corrupt, foreign, other layout)."""


def block_path(directory: Path, key: bytes) -> Path:
    return directory / f"{key.hex()}{SUFFIX}"


def _checksum(parts) -> bytes:
    h = hashlib.blake2b(digest_size=_CHECKSUM_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def encode_block(block: StoredBlock) -> list:
    """The file's contents as a list of buffers (the tensors' bytes are not copied)."""
    header = json.dumps(
        {
            "key": block.key.hex(),
            "parent": block.parent.hex(),
            "tokens": list(block.token_ids),
            "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in block.tensors],
        }
    ).encode()
    parts = [MAGIC, struct.pack("<I", len(header)), header]
    parts += [t.reshape(-1).view(torch.uint8).numpy() for t in block.tensors]
    return [*parts, _checksum(parts)]


def read_block(
    path: Path, key: bytes, parent: bytes, token_ids: Sequence[int], layout: BlockLayout
) -> list[torch.Tensor]:
    """The block's cache tensor slices from its file (FileNotFoundError: not stored; BadBlockFile:
    the file is not this block)."""
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(buf) != len(buf):
            raise BadBlockFile("short read")
    head = len(MAGIC) + 4
    if len(buf) < head + _CHECKSUM_BYTES or buf[: len(MAGIC)] != MAGIC:
        raise BadBlockFile("not a block file")
    view = memoryview(buf)
    if _checksum([view[:-_CHECKSUM_BYTES]]) != bytes(view[-_CHECKSUM_BYTES:]):
        raise BadBlockFile("checksum mismatch (truncated or corrupt)")
    (header_len,) = struct.unpack_from("<I", buf, len(MAGIC))
    header = json.loads(bytes(view[head : head + header_len]))
    if header["key"] != key.hex() or header["parent"] != parent.hex() or header["tokens"] != list(token_ids):
        raise BadBlockFile("another block's file (foreign key, parent or tokens)")
    want = [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in layout]
    if header["tensors"] != want:
        raise BadBlockFile(f"cache layout {header['tensors']} is not this engine's {want}")
    offset, tensors = head + header_len, []
    for shape, dtype in layout:
        n = torch.Size(shape).numel() * dtype.itemsize
        tensors.append(torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape))
        offset += n
    if offset != len(buf) - _CHECKSUM_BYTES:
        raise BadBlockFile("size does not match the layout")
    return tensors


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:  # another engine on the directory removed it first
        pass


@dataclass
class WriterStats:
    """What the writer did (cumulative): blocks and bytes written, seconds spent writing (its own
    thread), blocks dropped (queue full or writing off), blocks evicted, write errors, the directory's
    size as last counted."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dropped: int = 0
    evicted: int = 0
    errors: int = 0
    usage_bytes: int = 0
    written_keys: list[bytes] = field(default_factory=list)  # since the last report: now on disk (or given up)


class BlockWriter:
    """Writes `StoredBlock`s into `directory` on a thread of its own, keeping the directory's `*.kv`
    files under `max_bytes` by removing the least recently used (oldest modification time) first."""

    def __init__(self, directory: Path, max_bytes: int, queue_blocks: int = 4096) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.stats = WriterStats()
        self.enabled = True
        self._lock = threading.Lock()  # stats and keys between the writer thread and the reports
        self._queue: queue.Queue[StoredBlock | None] = queue.Queue(queue_blocks)
        self._usage = self._rescan()[1]
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-disk", daemon=True)
        self._thread.start()

    def put(self, blocks: list[StoredBlock]) -> None:
        """Queue blocks to write; never waits (a full queue, or writing off, drops them)."""
        for i, block in enumerate(blocks):
            if not self.enabled:
                self._give_up(blocks[i:])
                return
            try:
                self._queue.put_nowait(block)
            except queue.Full:
                self._give_up(blocks[i:])
                return

    def _give_up(self, blocks: list[StoredBlock]) -> None:
        with self._lock:
            self.stats.dropped += len(blocks)
            self.stats.written_keys += [b.key for b in blocks]

    def report(self) -> WriterStats:
        """The counters so far, and the keys finished since the last report."""
        with self._lock:
            keys, self.stats.written_keys = self.stats.written_keys, []
            self.stats.usage_bytes = self._usage
            return WriterStats(**{**self.stats.__dict__, "written_keys": keys})

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (at most `timeout` seconds) until the queued blocks are written."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (within `timeout`), then stop the thread."""
        if self._thread.is_alive():
            self.flush(timeout)
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            try:
                self._write(block)
            except Exception:  # noqa: BLE001 - a cache write must never take the engine down
                logger.exception("KV disk tier: writing a block failed; writing is off from now on")
                self._fail()
            finally:
                with self._lock:
                    self.stats.written_keys.append(block.key)
                self._queue.task_done()

    def _fail(self) -> None:
        self.enabled = False
        with self._lock:
            self.stats.errors += 1

    def _write(self, block: StoredBlock) -> None:
        if not self.enabled:
            with self._lock:
                self.stats.dropped += 1
            return
        start = time.perf_counter()
        path = block_path(self.directory, block.key)
        if path.exists():  # written by another engine on this directory (or before a restart)
            try:
                os.utime(path)
            except FileNotFoundError:  # and evicted by one just now: nothing to do either way
                pass
            return
        parts = encode_block(block)
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        if size > self.max_bytes:
            logger.warning(
                "KV disk tier: one block takes %d bytes, more than --kv-disk-size allows (%d): writing is off",
                size,
                self.max_bytes,
            )
            self._fail()
            return
        if self._usage + size > self.max_bytes and not self._evict(self.max_bytes * _EVICT_TO - size, block.mtime):
            with self._lock:  # every file is more recent than this block: it is the one to go
                self.stats.dropped += 1
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            if block.mtime is not None:
                os.utime(tmp, (block.mtime, block.mtime))
            os.replace(tmp, path)
        except OSError as e:
            remove(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                logger.warning(
                    "KV disk tier: %s is full (%s): writing is off, requests go on without it", path.parent, e
                )
                self._fail()
                return
            raise
        self._usage += size
        with self._lock:
            self.stats.blocks += 1
            self.stats.bytes += size
            self.stats.seconds += time.perf_counter() - start

    def _rescan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """The directory's block files, least recently used first, and their total size; temporary
        files a dead writer left behind are removed."""
        files, now = [], time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_SECONDS:
                    remove(Path(entry.path))
        files.sort()
        return files, sum(size for _, size, _ in files)

    def _evict(self, target: float, older_than: float | None) -> bool:
        """Remove the least recently used files (only those older than `older_than`, if given) until the
        directory (every engine's files, counted afresh) takes at most `target` bytes; whether it does."""
        files, usage = self._rescan()
        for mtime, size, path in files:
            if usage <= target or (older_than is not None and mtime >= older_than):
                break
            remove(path)
            usage -= size
            with self._lock:
                self.stats.evicted += 1
        self._usage = usage
        return usage <= target
