"""Executors run the model for the engine core: `Executor` is the interface, `UniProcExecutor`
runs one model runner in the core's own process, `MultiprocExecutor` one per tensor- or context-parallel rank
(the driver in the core's process, workers in their own or in Ray actors) over torch.distributed,
`PipelineExecutor` the same with the decoder layers in pipeline stages."""

from tokenmill.config import EngineConfig
from tokenmill.executor.abstract import Executor
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.executor.pipeline import PipelineExecutor
from tokenmill.executor.uniproc import UniProcExecutor


def executor_for(config: EngineConfig) -> Executor:
    """The executor `config.parallel` asks for (loads the model)."""
    if config.parallel.pipeline_parallel_size > 1:
        return PipelineExecutor(config)
    if config.parallel.world_size > 1:  # tensor and / or context parallelism
        return MultiprocExecutor(config)
    return UniProcExecutor(config)


__all__ = ["Executor", "MultiprocExecutor", "PipelineExecutor", "UniProcExecutor", "executor_for"]
