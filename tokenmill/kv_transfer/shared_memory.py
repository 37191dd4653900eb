"""`SharedMemoryConnector`: KV blocks through POSIX shared memory, producer and consumer on one host.

The producer copies a prompt's payload into a new shared-memory segment and announces it in the
store under the transfer id (segment name, number of blocks). The consumer looks for that key (again
and again, up to `kv_timeout`: `KVTransport.fetch`), copies the payload out, and unlinks the segment. Segments the consumer never took are
unlinked by the producer after `kv_timeout`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from tokenmill.kv_transfer.connector import BLOCK_DIM, KVTransferError, KVTransport

logger = logging.getLogger(__name__)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


class SharedMemoryConnector(KVTransport):
    def __init__(self, config, layout, device) -> None:
        super().__init__(config, layout, device)
        self._segments: dict[str, float] = {}  # producer: segments offered, by when

    def send(self, transfer_id: str, tensors: list[torch.Tensor]) -> None:
        self._unlink_expired()
        flat = [_as_bytes(t.cpu()) for t in tensors]
        segment = shared_memory.SharedMemory(
            name=f"tokenmill-kv-{uuid.uuid4().hex[:20]}", create=True, size=max(1, sum(f.numel() for f in flat))
        )
        # the consumer unlinks it: this process's resource tracker must not (and must not warn at exit)
        resource_tracker.unregister(segment._name, "shared_memory")
        view, offset = torch.frombuffer(segment.buf, dtype=torch.uint8), 0
        for f in flat:
            view[offset : offset + f.numel()] = f
            offset += f.numel()
        del view
        segment.close()
        self._segments[segment.name] = time.monotonic()
        self.store.set(
            f"ready/{transfer_id}", json.dumps({"segment": segment.name, "blocks": tensors[0].shape[BLOCK_DIM]})
        )

    def _unlink_expired(self) -> None:
        now = time.monotonic()
        for name in [n for n, born in self._segments.items() if now - born > self.config.kv_timeout]:
            del self._segments[name]
            try:
                segment = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                continue  # the consumer took it
            segment.close()
            segment.unlink()
            logger.warning("KV segment %s was never taken by the consumer; unlinked", name)

    def _receive(self, transfer_id: str) -> list[torch.Tensor] | None:
        key = f"ready/{transfer_id}"
        try:
            if not self.store.check([key]):
                return None
            meta = json.loads(self.store.get(key))
            self.store.delete_key(key)
        except Exception as e:  # noqa: BLE001 - the producer (the store's host) is gone
            self.store = None  # reconnect on the next fetch
            raise KVTransferError(
                f"KV transfer {transfer_id!r}: lost the producer at {self.config.kv_ip}:{self.config.kv_port} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
        try:
            segment = shared_memory.SharedMemory(name=meta["segment"])
        except FileNotFoundError:
            raise KVTransferError(f"KV transfer {transfer_id!r}: its shared-memory segment is gone") from None
        try:
            payload = self.empty(meta["blocks"])
            view, offset = torch.frombuffer(segment.buf, dtype=torch.uint8), 0
            for t in payload:
                n = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(view[offset : offset + n])
                offset += n
            del view
        finally:
            segment.close()
            segment.unlink()
        return payload
