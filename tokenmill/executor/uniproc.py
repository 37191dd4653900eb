"""`UniProcExecutor`: one model runner in this process (one device)."""

from __future__ import annotations

from tokenmill.attention.kv_spec import KVCacheConfig
from tokenmill.config import EngineConfig
from tokenmill.engine.outputs import ModelRunnerOutput
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.executor.abstract import Executor, load_target_model, size_kv_cache
from tokenmill.kv_transfer.base import KVConnectorWorker, worker_connector
from tokenmill.loader import LoadedModel
from tokenmill.worker import memory_profile
from tokenmill.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """`loaded`: an already loaded model to run (else the config's model is loaded here). With a KV
    connector configured, its worker half runs around each step of the runner."""

    kv_connector: KVConnectorWorker | None = None

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            loaded = load_target_model(config)
        self.model_config, self.source = loaded.config, loaded.source
        self.dtype, self.device, self.quantization = loaded.dtype, loaded.device, loaded.quantization
        self.runner = ModelRunner(loaded, config)

    def initialize_kv_cache(self) -> KVCacheConfig:
        kv_config = size_kv_cache(self.config, self.runner.kv_cache_specs(), self._measured_kv_budget())
        self._share("kv", kv_config)
        self.runner.initialize_kv_cache(kv_config)
        self.runner.warm_up()
        self.kv_connector = worker_connector(self.config, self.runner)
        return kv_config

    def _measured_kv_budget(self) -> int | None:
        """`--gpu-memory-utilization`: the KV pool's bytes from the device's memory after a profiling
        step at the largest batch (`worker/memory_profile.py`); None when the cache is sized otherwise."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.gpu_memory_utilization is None or cache.num_blocks is not None:
            return None
        profile = memory_profile.measure(
            memory_profile.DeviceMemory(self.device),
            lambda: memory_profile.run_profile_step(
                self.runner,
                cache.block_size,
                sched.max_num_batched_tokens,
                sched.max_num_seqs,
                sched.max_model_len or self.model_config.max_position_embeddings,
            ),
        )
        return memory_profile.kv_cache_budget(cache.gpu_memory_utilization, profile)

    def expert_load(self) -> dict[int, list[int]]:
        return self.runner.expert_load()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._share("step", sched)
        if self.kv_connector is None:
            return self.runner.execute(sched)
        return self.kv_connector.execute(sched, self.runner.execute)

    def load_lora(self, name: str, path: str) -> None:
        self.runner.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.runner.unload_lora(name)

    def close(self) -> None:
        """Release the KV connector's worker half (its connections and threads)."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def _share(self, kind: str, payload: object) -> None:
        """Hand what this runner is about to run to the other ranks' runners (there are none here)."""
