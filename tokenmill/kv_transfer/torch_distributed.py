"""`TorchDistributedConnector`: KV blocks over a 2-rank torch.distributed process group (gloo on CPU,
NCCL on CUDA) formed on the producer's TCPStore, point to point (send/recv).

Requests are ordered through the store: the consumer numbers each fetch (`store.add`) and writes the
transfer id under that number; the producer's sender thread (blocked in a store `wait` on its own
connection, woken by the consumer's key or by `close`) serves the numbers in turn — a header
(found or not, number of blocks), then each tensor of the payload — and the consumer receives in the
same order, so the two sides never disagree on what the next message is. A transfer the producer does
not have is answered "not found" at once (the consumer asks again: `KVTransport.fetch`). Any failure of the group itself (the peer died)
leaves the connector broken: every later fetch fails at once, saying why.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.kv_transfer.connector import BLOCK_DIM, KVTransferError, KVTransport, StagedPayloads

logger = logging.getLogger(__name__)

_PRODUCER, _CONSUMER = 0, 1
_FOREVER = timedelta(days=365)  # the sender waits for the consumer's next fetch without a deadline


class TorchDistributedConnector(KVTransport):
    def __init__(self, config, layout, device) -> None:
        self.group = None
        self._sender: threading.Thread | None = None
        self._waiting_for = "consumer"  # the store key the sender thread waits for
        self.broken: str | None = None
        super().__init__(config, layout, device)
        if config.is_producer:
            self.staged = StagedPayloads(config.kv_timeout)
            self._sender = threading.Thread(target=self._serve, name="tokenmill-kv-sender", daemon=True)
            self._sender.start()

    def _new_group(self, store: dist.Store):
        """The 2-rank group (blocks until the other side constructs it too)."""
        rank, prefixed = self.config.kv_rank, dist.PrefixStore("kv-group", store)
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(prefixed, rank, 2)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout * 2  # longer than the producer's "not found" wait
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.config.kv_ip)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)

    def _joined(self, store: dist.Store) -> None:
        store.set("consumer", "1")  # the producer forms the group once it sees this
        self.group = self._new_group(store)

    def _send_tensor(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], _CONSUMER, 0).wait()

    def _recv_tensor(self, tensor: torch.Tensor) -> None:
        self.group.recv([tensor], _PRODUCER, 0).wait()

    # ---- producer ---------------------------------------------------------------------------------

    def send(self, transfer_id: str, tensors: list[torch.Tensor]) -> None:
        self.staged.put(transfer_id, tensors)

    def _wait_key(self, store: dist.Store, key: str) -> bool:
        """Wait for `key` in the store; False if the connector closed meanwhile (`close` sets the key)."""
        self._waiting_for = key
        store.wait([key], _FOREVER)
        return not self.closed.is_set()

    def _serve(self) -> None:
        """Sender thread: form the group when the consumer comes, then answer its numbered fetches."""
        try:
            store = self._open_store(master=False)  # this thread's own connection to the store
            if not self._wait_key(store, "consumer"):
                return
            self.group = self._new_group(store)
            number = 0
            while True:
                number += 1
                key = f"want/{number}"
                if not self._wait_key(store, key):
                    return
                transfer_id = store.get(key).decode()
                store.delete_key(key)
                tensors = self.staged.take(transfer_id)
                num_blocks = tensors[0].shape[BLOCK_DIM] if tensors else 0
                self._send_tensor(
                    torch.tensor([tensors is not None, num_blocks], dtype=torch.int64, device=self.device)
                )
                for t in tensors or ():
                    self._send_tensor(t)
        except Exception as e:  # noqa: BLE001 - the consumer is gone: nothing more can be sent
            if not self.closed.is_set():
                logger.error("KV transfer sender stopped: %s", e)

    # ---- consumer ---------------------------------------------------------------------------------

    def _receive(self, transfer_id: str) -> list[torch.Tensor] | None:
        if self.broken:
            raise KVTransferError(self.broken)
        try:
            number = self.store.add("wanted", 1)
            self.store.set(f"want/{number}", transfer_id)
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._recv_tensor(header)
            found, num_blocks = header.tolist()
            payload = self.empty(num_blocks) if found else []
            for t in payload:
                self._recv_tensor(t)
        except Exception as e:  # noqa: BLE001 - the producer (or the link) is gone
            self.broken = (
                f"KV transfer: lost the producer at {self.config.kv_ip}:{self.config.kv_port} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); restart both servers"
            )
            raise KVTransferError(self.broken) from None
        return payload if found else None

    def close(self) -> None:
        super().close()
        if self._sender is not None:
            self.store.set(self._waiting_for, "")  # wake the sender thread: it sees the connector closed
            self._sender.join(1)
        self.group = None
