"""The executor interface the engine core talks to."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

from tokenmill.attention.kv_spec import AttentionSpec, KVCacheConfig, make_kv_cache_config
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.outputs import ModelRunnerOutput
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.loader import LoadedModel, load_configured_model
from tokenmill.loader.source import ModelSource
from tokenmill.worker.offload import host_placement_planner


class Executor(ABC):
    """Loads the model on its workers; sizes and allocates their KV caches; runs steps.

    Describes what it runs for the core and the server: `model_config`, `source`, `dtype`, `device`
    and `quantization` (the weight format applied)."""

    config: EngineConfig
    model_config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    quantization: str
    # steps in flight at once (the engine core's batch queue): above 1 a pipeline, one step per stage
    max_concurrent_batches: int = 1
    _done: ModelRunnerOutput | None = None  # `submit`'s output until `collect` (one step at a time)

    @abstractmethod
    def initialize_kv_cache(self) -> KVCacheConfig:
        """Size the paged KV cache from the layers' specs and the cache config (the same block count
        on every worker), allocate it, warm the model up on it (kernels built before the first request),
        and return it: the core's block pool has that many blocks."""

    @abstractmethod
    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by decoder layer index (empty for a dense model)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every worker; the sampled tokens (from the driver worker)."""

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step; its output comes from `collect`, in submission order. An executor that runs
        one step at a time runs it here (a failure raises here)."""
        self._done = self.execute(sched)

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not collected yet."""
        output, self._done = self._done, None
        return output

    def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter into the runner (`lora.peft.LoRAError` if it cannot be). LoRA runs on one
        process: only the in-process executor has it (the config refuses the others at start; this answers a
        request that still reaches one with a 400, not a 500)."""
        self._no_lora()

    def unload_lora(self, name: str) -> None:
        self._no_lora()

    @staticmethod
    def _no_lora() -> None:
        from tokenmill.lora.peft import LoRAError

        raise LoRAError("LoRA adapters run with one process only (no tensor or pipeline parallelism)", "lora_name")

    def check_health(self) -> None:
        """Raise (saying why) if a worker this executor needs is gone."""

    def close(self) -> None:
        """Release what the executor started (worker processes or actors, the process group); nothing
        for a runner in this process."""


def load_target_model(config: EngineConfig) -> LoadedModel:
    """The model `config` names (`load_configured_model`), with the layers and experts --cpu-offload-gb /
    --cpu-moe keep in host memory placed there as it loads."""
    return load_configured_model(
        config, plan_host=host_placement_planner(config.offload) if config.offload.active else None
    )


def size_kv_cache(
    config: EngineConfig, specs: dict[str, AttentionSpec], budget_bytes: int | None = None
) -> KVCacheConfig:
    """The paged KV cache for layers with these specs, as the cache and scheduler configs ask (or in
    `budget_bytes`, measured from the device: `--gpu-memory-utilization`)."""
    sched, cache = config.scheduler, config.cache
    if budget_bytes is not None and cache.num_blocks is None:
        cache = dataclasses.replace(cache, kv_cache_memory_gib=budget_bytes / 2**30)
    return make_kv_cache_config(
        specs, cache, sched.max_num_seqs, sched.max_num_batched_tokens, config.parallel.context_parallel_size
    )
