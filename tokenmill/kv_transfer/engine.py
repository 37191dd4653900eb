"""The engine core's side of disaggregated prefill/decode (`EngineCore.kv_transfer`).

Producer: a request carrying a transfer id runs its prompt and samples one token (max_tokens is
forced to 1); in the step that completes its prompt, right after the forward pass and before its
blocks return to the pool, the prompt's blocks of every cache tensor (all layers; scales of a
quantized cache too) are copied out and offered to the connector under the transfer id.

Consumer: a request carrying a transfer id is held here (not scheduled) while the connector fetches
its KV. Once the payload is in, it gets blocks for its prompt, the payload is written into them, and
it joins the scheduler with all prompt tokens but the last counted as computed
(`Request.num_external_tokens`): its first step recomputes the last prompt token to get the logits
of the first output token, as after a prefix-cache hit, then it decodes. A failed fetch finishes
the request with an error; an aborted one drops it; blocks always return to the pool.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

import torch

from tokenmill.kv_transfer import CONNECTORS
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.connector import BLOCK_DIM, KVTransferError, layout_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TransferStats:
    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # producer: copying out and offering; consumer: from asking to having the payload

    def record(self, tensors: list[torch.Tensor], seconds: float) -> None:
        self.num_transfers += 1
        self.num_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.seconds += seconds


class KVTransfer:
    def __init__(self, config: KVTransferConfig, core) -> None:
        runner = getattr(core.executor, "runner", None)
        if runner is None or core.config.parallel.tensor_parallel_size != 1:
            raise ValueError("--kv-role needs --tensor-parallel-size 1 (KV transfer between tensor-parallel "
                             "engines is not built)")
        if core.config.speculative is not None and core.config.speculative.method == "draft_model":
            raise ValueError("--kv-role does not work with a draft model (its own KV cache is not transferred)")
        self.config, self.core = config, core
        groups = runner.kv_cache_config.groups
        # every cache tensor (and quantized caches' scales) with the pool its blocks come from
        self.tensors = [(t, g.pool) for g, cache, scales in zip(groups, runner.kv_caches, runner.kv_scales)
                        for t in (cache, scales) if t is not None]
        self.device = runner.device
        self.connector = CONNECTORS[config.kv_connector]()(config, layout_of([t for t, _ in self.tensors]),
                                                           self.device)
        self.receiving: dict[str, tuple[object, Future, float]] = {}  # consumer: request id -> (request, fetch, start)
        self.stats = TransferStats()
        atexit.register(self.close)

    def _num_blocks(self, request) -> int:
        return -(-request.num_prompt_tokens // self.core.kv.block_size)

    # ---- producer ---------------------------------------------------------------------------------

    def prefill_only(self, params):
        """A producer's copy of a transfer request's params: one output token (the consumer decodes)."""
        return dataclasses.replace(params, max_tokens=1, min_tokens=0)

    def send_prefilled(self, sched) -> None:
        """After the step's forward pass: offer the KV of each transfer request whose prompt it completed."""
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = self.core.requests.get(rid)
            if request is None or request.params.kv_transfer_id is None:
                continue
            if request.num_computed_tokens < request.num_prompt_tokens <= request.num_computed_tokens + num_new:
                start = time.perf_counter()
                n = self._num_blocks(request)
                tables = self.core.kv.block_ids(rid)
                payload = [t.index_select(BLOCK_DIM, torch.tensor(tables[pool][:n], device=self.device))
                           for t, pool in self.tensors]
                self.connector.send(request.params.kv_transfer_id, payload)
                self.stats.record(payload, time.perf_counter() - start)

    # ---- consumer ---------------------------------------------------------------------------------

    def receives(self, request) -> bool:
        """Whether the request's KV comes from the producer (this is the consumer and it carries a transfer id)."""
        return not self.config.is_producer and request.params.kv_transfer_id is not None

    def start_receiving(self, request) -> None:
        self.receiving[request.request_id] = (request, self.connector.fetch(request.params.kv_transfer_id),
                                              time.perf_counter())

    def admit_received(self) -> list[tuple[str, str]]:
        """Requests whose KV arrived: into blocks and on to the scheduler (those that fit in the pool now;
        the rest wait). Returns (request id, error) of the fetches that failed."""
        failed = []
        for rid, (request, future, start) in list(self.receiving.items()):
            if not future.done():
                continue
            error = future.exception()
            if error is None:
                payload = future.result()
                got, need = payload[0].shape[BLOCK_DIM] if payload else 0, self._num_blocks(request)
                if got != need:
                    error = KVTransferError(f"the producer sent {got} KV blocks, the prompt needs {need} (both servers "
                                            "must get the same prompt and --block-size)")
            if error is not None:
                del self.receiving[rid]
                logger.warning("request %s: %s", rid, error)
                failed.append((rid, str(error) if isinstance(error, KVTransferError) else f"KV transfer failed: {error}"))
                continue
            if not self.core.kv.allocate_slots(request, request.num_prompt_tokens):
                continue  # no room yet: try again next step
            tables = self.core.kv.block_ids(rid)
            for (t, pool), part in zip(self.tensors, payload):
                t.index_copy_(BLOCK_DIM, torch.tensor(tables[pool][:need], device=self.device), part)
            request.num_external_tokens = request.num_prompt_tokens - 1
            del self.receiving[rid]
            self.stats.record(payload, time.perf_counter() - start)
            self.core.scheduler.add(request)
        return failed

    def wait(self, timeout: float) -> None:
        """Idle consumer: wait (a bounded time) for a fetch to finish instead of spinning."""
        if self.receiving:
            wait_futures([f for _, f, _ in self.receiving.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def abort(self, request_id: str) -> bool:
        """Drop a request still waiting for its KV (it holds no blocks yet); False if it is not waiting."""
        return self.receiving.pop(request_id, None) is not None

    def close(self) -> None:
        self.connector.close()
