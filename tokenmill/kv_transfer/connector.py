"""The transports of disaggregated prefill/decode (`kv_connector`: `TorchDistributedConnector`,
`SharedMemoryConnector`): how the worker half of a producer engine's KV connector hands the KV blocks
of a prefilled prompt to a consumer engine's (`disaggregated.py`).

Both sides meet at a torch.distributed `TCPStore` the producer hosts (`kv_ip`:`kv_port`). A payload is
a list of tensors laid out like the engine's caches (`KVLayout`: one entry per cache tensor, its
blocks along `BLOCK_DIM`), holding a prompt's blocks in order; at the rendezvous the consumer checks
that the producer's layout is its own (same model, dtype, block size and cache dtype on both).

The producer's `send(transfer_id, tensors)` returns at once (the connector keeps the payload until the
consumer takes it, or `kv_timeout` passes). The consumer's `fetch(transfer_id)` returns a Future of the
payload; fetches run on one connector thread, and fail (never hang) when the producer is gone or the
transfer takes longer than `kv_timeout`. A transfer the producer does not have (yet) is asked for again
every `RETRY_SECONDS` until `kv_timeout`, each time behind the fetches asked since: a transfer id that
never comes (a client's own invention) holds no one else's transfer up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

BLOCK_DIM = 2  # caches are [layers, K/V, blocks, block size, heads, head dim] (scales: without the last dim)
KVLayout = list[tuple[tuple[int, ...], torch.dtype]]  # per cache tensor: its shape with one block, its dtype
RETRY_SECONDS = 0.05  # how soon a fetch asks again for a transfer the producer does not have yet


class KVTransferError(RuntimeError):
    """A transfer that cannot complete (producer gone, unknown transfer id, timeout, layout mismatch)."""


def layout_of(tensors: list[torch.Tensor]) -> KVLayout:
    return [(tuple(1 if d == BLOCK_DIM else n for d, n in enumerate(t.shape)), t.dtype) for t in tensors]


def describe(layout: KVLayout) -> str:
    return "; ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in layout)


class KVTransport(ABC):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, device: torch.device) -> None:
        self.config, self.layout, self.device = config, layout, device
        self.timeout = timedelta(seconds=config.kv_timeout)
        self.closed = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv")
        self.store: dist.Store | None = None
        if config.is_producer:  # hosts the store now: a busy port is a startup error
            self.store = self._open_store()
            self.store.set("layout", describe(layout))
        else:  # connect in the background (retried by each fetch until it succeeds)
            self._pool.submit(self._connect)

    def _open_store(self, master: bool | None = None) -> dist.TCPStore:
        """The producer's store: hosted here (`master`: by default on the producer) or a connection to it."""
        c = self.config
        master = c.is_producer if master is None else master
        try:
            return dist.TCPStore(c.kv_ip, c.kv_port, 2, is_master=master, timeout=self.timeout, wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - say which side and where
            what = "listen" if master else "reach the producer's store"
            raise KVTransferError(f"KV transfer: cannot {what} at {c.kv_ip}:{c.kv_port}: {e}") from None

    def _connect(self) -> None:
        """Consumer: join the producer's store, check its layout, then `_joined` (connector-specific)."""
        if self.store is not None:
            return
        store = self._open_store()
        theirs, ours = store.get("layout").decode(), describe(self.layout)
        if theirs != ours:
            raise KVTransferError(
                f"KV transfer: the producer's KV cache layout ({theirs}) differs from this "
                f"consumer's ({ours}); both need the same model, dtype, block size and KV cache dtype"
            )
        self._joined(store)
        self.store = store

    def _joined(self, store: dist.Store) -> None:
        """Consumer: after the store is reached (e.g. form a process group)."""

    def empty(self, num_blocks: int) -> list[torch.Tensor]:
        """A payload of `num_blocks` blocks to receive into."""
        return [
            torch.empty(
                tuple(num_blocks if d == BLOCK_DIM else n for d, n in enumerate(shape)), dtype=dtype, device=self.device
            )
            for shape, dtype in self.layout
        ]

    @abstractmethod
    def send(self, transfer_id: str, tensors: list[torch.Tensor]) -> None:
        """Producer: offer a prompt's blocks (copies: the caller's blocks may be reused at once)."""

    def fetch(self, transfer_id: str) -> Future:
        """Consumer: a Future of the payload the producer sent as `transfer_id` (cancel it to stop asking)."""
        future: Future = Future()
        deadline = time.monotonic() + self.config.kv_timeout

        def settle(result=None, error: BaseException | None = None) -> None:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(result)

        def attempt() -> None:
            if future.cancelled() or self.closed.is_set():
                return
            try:
                self._connect()
                payload = self._receive(transfer_id)
            except BaseException as e:  # noqa: BLE001 - the request's failure, said by the future
                return settle(error=e)
            if payload is not None:
                return settle(payload)
            if time.monotonic() >= deadline:
                return settle(
                    error=KVTransferError(
                        f"KV transfer {transfer_id!r}: the producer has no KV for it after "
                        f"{self.config.kv_timeout:g} s (its prefill failed, was aborted or never ran, or expired)"
                    )
                )
            timer = threading.Timer(RETRY_SECONDS, self._submit, (attempt,))
            timer.daemon = True
            timer.start()

        self._submit(attempt)
        return future

    def _submit(self, work) -> None:
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the connector closed
            self._pool.submit(work)

    @abstractmethod
    def _receive(self, transfer_id: str) -> list[torch.Tensor] | None:
        """Consumer, on the connector thread: the payload, None if the producer does not have it (yet), or
        raise KVTransferError."""

    def close(self) -> None:
        self.closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


class StagedPayloads:
    """Producer: payloads by transfer id until taken, dropped after `timeout` seconds (a consumer that
    never asked must not hold memory forever)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._items: dict[str, tuple[float, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def put(self, transfer_id: str, tensors: list[torch.Tensor]) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in [t for t, (born, _) in self._items.items() if now - born > self.timeout]:
                logger.warning("KV transfer %s was never taken by the consumer; dropped", tid)
                del self._items[tid]
            self._items[transfer_id] = (now, tensors)

    def take(self, transfer_id: str) -> list[torch.Tensor] | None:
        """The payload, or None if it is not here (not yet, or no more)."""
        with self._lock:
            item = self._items.pop(transfer_id, None)
        return None if item is None else item[1]
