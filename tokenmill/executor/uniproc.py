"""`UniProcExecutor`: one model runner in this process (one device)."""

from __future__ import annotations

from tokenmill.attention.kv_spec import KVCacheConfig, make_kv_cache_config
from tokenmill.config import EngineConfig
from tokenmill.engine.outputs import ModelRunnerOutput
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.executor.abstract import Executor
from tokenmill.loader import LoadedModel, load_model
from tokenmill.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """`loaded`: an already loaded model to run (else the config's model is loaded here)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            loaded = load_model(config.model, config.dtype, config.device, max_positions=config.scheduler.max_model_len,
                                quantization=config.quantization, group_size=config.quantization_group_size,
                                symmetric=config.quantization_symmetric)
        self.model_config, self.source = loaded.config, loaded.source
        self.dtype, self.device, self.quantization = loaded.dtype, loaded.device, loaded.quantization
        self.runner = ModelRunner(loaded, config)

    def initialize_kv_cache(self) -> KVCacheConfig:
        sched = self.config.scheduler
        kv_config = make_kv_cache_config(self.runner.kv_cache_specs(), self.config.cache, sched.max_num_seqs,
                                         sched.max_num_batched_tokens)
        self.runner.initialize_kv_cache(kv_config)
        self.runner.warm_up()
        return kv_config

    def expert_load(self) -> dict[int, list[int]]:
        return self.runner.expert_load()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)
