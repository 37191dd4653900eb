"""The KV connector seam: KV-cache contents that come from, or go to, somewhere outside this engine's
pool (another engine's prefill: `disaggregated.py`; the KV cache's tiers: `host_tier.py`, `disk_tier.py`),
in two halves as vLLM's KV connector has them.

The scheduler half (`KVConnectorScheduler`) lives in the engine core. When the scheduler admits a
waiting request it asks `get_num_new_matched_tokens`: how many prompt tokens, beyond the pool's own
prefix-cache hits, this connector can supply; those count as computed, and once the request has its
blocks `update_state_after_alloc` notes which blocks to fill. `build_connector_meta` turns what it
decided this step into a `KVConnectorMetadata` that rides on the `SchedulerOutput` to the workers;
`update_connector_output` takes the worker half's report back; `request_finished` forgets a request.

The worker half (`KVConnectorWorker`) lives next to the model runner, which owns the KV caches: it
writes loaded blocks into the cache before the step's forward (`start_load_kv`), copies out the
blocks to save after it (`wait_for_save`), and reports what completed meanwhile (`get_finished`) as a
`KVConnectorOutput` riding back on the `ModelRunnerOutput`. The core never touches the caches, and
the halves share nothing but these two messages, so the worker half may live in another process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.outputs import ModelRunnerOutput
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler_output import SchedulerOutput

BlockTable = list[list[int]]  # block ids per KV pool


class KVConnectorMetadata:
    """What the worker half does in one step (each connector subclasses it with its own fields, as
    plain data: it may be sent to worker processes)."""


class KVConnectorOutput:
    """What the worker half finished since its last report (each connector subclasses it)."""


@dataclass
class TransferStats:
    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # producer: copying out and offering; consumer: from asking to having the payload

    def record(self, num_bytes: int, seconds: float) -> None:
        self.num_transfers += 1
        self.num_bytes += num_bytes
        self.seconds += seconds


class KVConnectorScheduler(ABC):
    """The engine core's half. Besides the vLLM-style hooks, a connector may hold a new request back
    until its KV is in (`hold`: a consumer of disaggregated prefill): held requests come back from
    `update_connector_output` once they can be scheduled."""

    def __init__(self) -> None:
        self.stats = TransferStats()  # KV moved by this connector (/metrics: tokenmill:kv_transfer*)

    def prepare(self, params):
        """The `SamplingParams` a request with these params runs with here (e.g. a prefill engine's one token)."""
        return params

    def hold(self, request: Request) -> bool:
        """Whether to keep a new request out of the scheduler until its KV is in."""
        return False

    def has_held(self) -> bool:
        """Whether requests are held (the engine has unfinished work)."""
        return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the first `num_computed_tokens` (the pool's hits, block-aligned) whose KV
        this connector supplies; the scheduler counts them as computed."""
        return 0

    def update_state_after_alloc(
        self, request: Request, blocks: BlockTable, num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """The request got its blocks: the connector's tokens go after the pool's `num_computed_tokens`."""

    @abstractmethod
    def build_connector_meta(self, sched: SchedulerOutput, requests: dict[str, Request]) -> KVConnectorMetadata | None:
        """This step's work for the worker half (None: nothing to do nor to hear back)."""

    def update_connector_output(self, output: KVConnectorOutput | None) -> tuple[list[Request], dict[str, str]]:
        """Take the worker half's report: the held requests now ready to schedule, and the request
        ids whose KV failed (-> why)."""
        return [], {}

    def request_finished(self, request: Request) -> bool:
        """Forget a request (finished or aborted); True if it was held here (it never reached the scheduler)."""
        return False

    def tier_stats(self) -> dict[str, dict]:
        """A KV-cache tier's counters by tier name (/metrics: tokenmill:kv_tier_*{tier=...}); none here."""
        return {}

    def step_failed(self, meta: KVConnectorMetadata) -> list[str]:
        """A step carrying `meta` raised: the held requests that can no longer get their KV (failed with it)."""
        return []


class KVConnectorWorker(ABC):
    """The worker half, next to the model runner's KV caches."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the forward: start fetches, write fetched KV into the blocks `meta.load` names."""

    @abstractmethod
    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """After the forward, before the step's blocks can return to the pool: save what `meta.save` names."""

    @abstractmethod
    def get_finished(self, idle: bool) -> KVConnectorOutput:
        """What finished since the last call; `idle` (the step ran no tokens): wait a little for it."""

    def execute(self, sched: SchedulerOutput, run: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
        """One step of the model runner (`run`) with this connector's work around it."""
        meta = sched.kv_connector_metadata
        if meta is None:
            return run(sched)
        self.start_load_kv(meta)
        output = run(sched)
        self.wait_for_save(meta)
        output.kv_connector_output = self.get_finished(idle=not sched.num_scheduled_tokens)
        return output

    def close(self) -> None:
        """Release what the connector holds (connections, threads)."""


def check_supported(config: EngineConfig) -> None:
    """Refuse, naming the flags, the layouts KV transfer and the KV-cache tiers do not run with (rather
    than hang or move part of the KV): each stage or tensor-parallel rank holds only its share of the
    cache (the tiers keep each tensor-parallel rank's share on its own; not each stage's yet: a stage's
    worker processes run no connector, a stage's share of a block has a layout of its own that the
    driver does not know, and only the last stage's report reaches the engine core)."""
    parallel, cache = config.parallel, config.cache
    for flag, value in (("--kv-cache-dir", cache.kv_cache_dir), ("--kv-offloading-size", cache.kv_offloading_size_gib)):
        if value is None:
            continue
        if config.kv_transfer is not None:
            raise ValueError(f"{flag} does not run with --kv-role yet (one KV connector per engine)")
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"{flag} needs --pipeline-parallel-size 1 (each stage holds its own layers' share of "
                "a block, and its worker processes run no KV connector yet); tensor parallelism works"
            )
    if cache.kv_offloading_size_gib is not None and not cache.enable_prefix_caching:
        raise ValueError("--kv-offloading-size keeps blocks the prefix cache lets go: it needs --enable-prefix-caching")
    if config.kv_transfer is None:
        return
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "--kv-role does not run with --pipeline-parallel-size > 1 yet (each pipeline stage holds "
            "its own layers' KV cache: KV transfer between pipeline stages is not built)"
        )
    if parallel.tensor_parallel_size != 1:
        raise ValueError(
            "--kv-role needs --tensor-parallel-size 1 (KV transfer between tensor-parallel engines is not built)"
        )
    if config.speculative is not None and config.speculative.method == "draft_model":
        raise ValueError("--kv-role does not work with a draft model (its own KV cache is not transferred)")


def scheduler_connector(config: EngineConfig, kv, executor) -> KVConnectorScheduler | None:
    """The engine core's half of the connector `config` asks for (None: none); `kv`: the engine's
    `KVCacheCoordinator` (read-only: block tables and block size); `executor`: the model it runs and
    the layout of its caches (what the disk tier's keys name)."""
    if config.cache.kv_offloading_size_gib is not None:
        from tokenmill.kv_transfer.host_tier import host_tier_scheduler

        return host_tier_scheduler(config, kv, executor)
    if config.cache.kv_cache_dir is not None:
        from tokenmill.kv_transfer.disk_tier import disk_tier_scheduler

        return disk_tier_scheduler(config, kv, executor)
    if config.kv_transfer is None:
        return None
    check_supported(config)
    from tokenmill.kv_transfer.disaggregated import DisaggregatedScheduler

    return DisaggregatedScheduler(config.kv_transfer, kv)


def worker_connector(config: EngineConfig, runner) -> KVConnectorWorker | None:
    """The worker half over `runner`'s KV caches (a `ModelRunner` whose cache is allocated), or None."""
    if config.cache.kv_offloading_size_gib is not None:
        from tokenmill.kv_transfer.host_tier import host_tier_worker

        return host_tier_worker(config, runner)
    if config.cache.kv_cache_dir is not None:
        from tokenmill.kv_transfer.disk_tier import disk_tier_worker

        return disk_tier_worker(config, runner)
    if config.kv_transfer is None:
        return None
    check_supported(config)
    from tokenmill.kv_transfer.disaggregated import DisaggregatedWorker

    return DisaggregatedWorker(config.kv_transfer, cache_tensors(runner), runner.device)


def cache_tensors(runner) -> list[tuple[torch.Tensor, int]]:
    """Every KV cache tensor of a model runner (quantized caches' scales too), with the pool its blocks
    come from: what a worker half copies a block of (its blocks along `kv_transfer.connector.BLOCK_DIM`)."""
    return [
        (t, g.pool)
        for g, cache, scales in zip(runner.kv_cache_config.groups, runner.kv_caches, runner.kv_scales)
        for t in (cache, scales)
        if t is not None
    ]
