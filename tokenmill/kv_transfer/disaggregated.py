"""Disaggregated prefill/decode as a KV connector (`--kv-role producer|consumer`), both halves.

Producer: a request carrying a transfer id runs its prompt and samples one token (max_tokens is
forced to 1). In the step that completes its prompt the scheduler half asks the worker half to save
its blocks; right after the forward pass, before the blocks can return to the pool, the worker copies
the prompt's blocks of every cache tensor (all layers; scales of a quantized cache too) and offers
them to the transport under the transfer id.

Consumer: a request carrying a transfer id is held by the scheduler half (not scheduled) while the
worker half fetches its KV. Once the payload is in, the request joins the scheduler, which counts
its prompt tokens but the last as computed (`get_num_new_matched_tokens`: those beyond the pool's own
prefix hits come from the payload); when it has its blocks the worker writes the payload into them
before the next forward. Its first step recomputes the last prompt token to get the logits of the
first output token, as after a prefix-cache hit, then it decodes. A failed fetch finishes the request
with an error; an aborted one is dropped on both halves; blocks always return to the pool.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from tokenmill.kv_transfer import CONNECTORS
from tokenmill.kv_transfer.base import (
    BlockTable,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.connector import BLOCK_DIM, KVTransferError, layout_of

logger = logging.getLogger(__name__)


@dataclass
class DisaggregatedMetadata(KVConnectorMetadata):
    """`fetch`: start getting a request's KV (request id -> transfer id); `load`: write the fetched KV
    of a request into its blocks (request id -> (its block table, first block to write)); `save`: copy a
    prompt's blocks out (request id -> (transfer id, block table, number of blocks)); `drop`: forget
    requests (aborted, or their KV not needed)."""

    fetch: dict[str, str] = field(default_factory=dict)
    load: dict[str, tuple[BlockTable, int]] = field(default_factory=dict)
    save: dict[str, tuple[str, BlockTable, int]] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)


@dataclass
class DisaggregatedOutput(KVConnectorOutput):
    """`fetched`: request id -> (blocks, bytes, seconds from asking to having them); `failed`: request
    id -> why its fetch failed; `saved`: (bytes, seconds) of each save."""

    fetched: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    saved: list[tuple[int, float]] = field(default_factory=list)


class DisaggregatedScheduler(KVConnectorScheduler):
    """`kv`: the engine's `KVCacheCoordinator` (block tables of the prompts to save)."""

    def __init__(self, config: KVTransferConfig, kv) -> None:
        super().__init__()
        self.config, self.kv = config, kv
        self.held: dict[str, object] = {}  # consumer: request id -> request, until its KV is in
        self._to_fetch: dict[str, str] = {}  # held requests whose fetch the worker has not been asked for
        self._fetched: set[str] = set()  # requests whose payload waits in the worker for their blocks
        self._load: dict[str, tuple[BlockTable, int]] = {}
        self._drop: set[str] = set()

    def _num_blocks(self, request) -> int:
        return -(-request.num_prompt_tokens // self.kv.block_size)

    def prepare(self, params):
        """A producer's copy of a transfer request's params: one output token (the consumer decodes)."""
        if self.config.is_producer and params.kv_transfer_id is not None:
            return dataclasses.replace(params, max_tokens=1, min_tokens=0)
        return params

    def hold(self, request) -> bool:
        if self.config.is_producer or request.params.kv_transfer_id is None:
            return False
        self.held[request.request_id] = request
        self._to_fetch[request.request_id] = request.params.kv_transfer_id
        return True

    def has_held(self) -> bool:
        return bool(self.held)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if request.request_id not in self._fetched:
            return 0
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(
        self, request, blocks: BlockTable, num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if rid not in self._fetched:
            return
        self._fetched.discard(rid)
        if num_external_tokens:
            self._load[rid] = ([list(t) for t in blocks], num_computed_tokens // self.kv.block_size)
        else:  # the pool had it all
            self._drop.add(rid)

    def build_connector_meta(self, sched, requests) -> DisaggregatedMetadata | None:
        meta = DisaggregatedMetadata(fetch=self._to_fetch, load=self._load, drop=self._drop)
        self._to_fetch, self._load, self._drop = {}, {}, set()
        if self.config.is_producer:
            for rid, num_new in sched.num_scheduled_tokens.items():
                request = requests.get(rid)
                if request is None or request.params.kv_transfer_id is None:
                    continue
                if request.num_computed_tokens < request.num_prompt_tokens <= request.num_computed_tokens + num_new:
                    meta.save[rid] = (request.params.kv_transfer_id, self.kv.block_ids(rid), self._num_blocks(request))
        if meta.fetch or meta.load or meta.save or meta.drop or self.held:  # held: the worker reports on them
            return meta
        return None

    def update_connector_output(self, output: DisaggregatedOutput | None):
        if output is None:
            return [], {}
        for num_bytes, seconds in output.saved:
            self.stats.record(num_bytes, seconds)
        ready, failed = [], {}
        for rid, error in output.failed.items():
            if self.held.pop(rid, None) is not None:
                failed[rid] = error
        for rid, (got, num_bytes, seconds) in output.fetched.items():
            request = self.held.pop(rid, None)
            if request is None:  # aborted meanwhile
                self._drop.add(rid)
                continue
            need = self._num_blocks(request)
            if got != need:
                self._drop.add(rid)
                failed[rid] = str(
                    KVTransferError(
                        f"the producer sent {got} KV blocks, the prompt needs {need} (both "
                        "servers must get the same prompt and --block-size)"
                    )
                )
                continue
            self.stats.record(num_bytes, seconds)
            self._fetched.add(rid)
            ready.append(request)
        for rid, error in failed.items():
            logger.warning("request %s: %s", rid, error)
        return ready, failed

    def step_failed(self, meta: DisaggregatedMetadata) -> list[str]:
        return [rid for rid in meta.fetch if rid in self.held]

    def request_finished(self, request) -> bool:
        rid = request.request_id
        if rid in self._fetched:
            self._fetched.discard(rid)
            self._drop.add(rid)
        if self.held.pop(rid, None) is None:
            return False
        if self._to_fetch.pop(rid, None) is None:  # the worker was asked for it: it forgets it too
            self._drop.add(rid)
        return True


class DisaggregatedWorker(KVConnectorWorker):
    """`tensors`: every cache tensor with the KV pool its blocks come from."""

    def __init__(self, config: KVTransferConfig, tensors: list[tuple[torch.Tensor, int]], device: torch.device) -> None:
        self.config, self.tensors, self.device = config, tensors, device
        self.transport = CONNECTORS[config.kv_connector]()(config, layout_of([t for t, _ in tensors]), device)
        self.fetching: dict[str, tuple[Future, float]] = {}  # request id -> (fetch, when asked)
        self.payloads: dict[str, list[torch.Tensor]] = {}  # fetched, until loaded or dropped
        self._saved: list[tuple[int, float]] = []
        atexit.register(self.close)

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, device=self.device)

    def start_load_kv(self, meta: DisaggregatedMetadata) -> None:
        for rid in meta.drop:
            future, _ = self.fetching.pop(rid, (None, 0.0))
            if future is not None:
                future.cancel()  # stop asking for it
            self.payloads.pop(rid, None)
        for rid, transfer_id in meta.fetch.items():
            self.fetching[rid] = (self.transport.fetch(transfer_id), time.perf_counter())
        for rid, (tables, first) in meta.load.items():
            payload = self.payloads.pop(rid)
            need = payload[0].shape[BLOCK_DIM] if payload else 0
            for (t, pool), part in zip(self.tensors, payload):
                t.index_copy_(
                    BLOCK_DIM, self._index(tables[pool][first:need]), part.narrow(BLOCK_DIM, first, need - first)
                )

    def wait_for_save(self, meta: DisaggregatedMetadata) -> None:
        for transfer_id, tables, num_blocks in meta.save.values():
            start = time.perf_counter()
            payload = [t.index_select(BLOCK_DIM, self._index(tables[pool][:num_blocks])) for t, pool in self.tensors]
            self.transport.send(transfer_id, payload)
            self._saved.append((sum(t.numel() * t.element_size() for t in payload), time.perf_counter() - start))

    def get_finished(self, idle: bool) -> DisaggregatedOutput:
        if idle and self.fetching:  # nothing else to do: wait (a bounded time) for a fetch instead of spinning
            wait_futures([f for f, _ in self.fetching.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        out, self._saved = DisaggregatedOutput(saved=self._saved), []
        for rid, (future, start) in list(self.fetching.items()):
            if not future.done():
                continue
            del self.fetching[rid]
            error = future.exception()
            if error is not None:
                out.failed[rid] = str(error) if isinstance(error, KVTransferError) else f"KV transfer failed: {error}"
                continue
            payload = self.payloads[rid] = future.result()
            out.fetched[rid] = (
                payload[0].shape[BLOCK_DIM] if payload else 0,
                sum(t.numel() * t.element_size() for t in payload),
                time.perf_counter() - start,
            )
        return out

    def close(self) -> None:
        self.transport.close()
