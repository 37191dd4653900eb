"""Executors run the model for the engine core: `Executor` is the interface, `UniProcExecutor`
runs one model runner in the core's own process. A multi-process executor (one worker per
tensor-parallel rank over torch.distributed) implements the same three calls."""

from tokenmill.executor.abstract import Executor
from tokenmill.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
