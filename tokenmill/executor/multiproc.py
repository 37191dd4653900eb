"""`MultiprocExecutor`: tensor parallelism over processes on this host. Rank 0 (the driver) runs in
the engine core's process; ranks 1..N-1 are worker processes (or Ray actors: `ray_workers.py`). Every rank loads its shard of the
model (layers take their share from `tokenmill.distributed.parallel_state`) and keeps its own model
runner with the same request states. Each step the driver broadcasts the scheduler's output to the
workers (one pickled object over the group) and every rank runs it: the collectives inside the
forward pair up, the gathered logits are the same bits on every rank, so every rank samples the same
tokens; the driver's are returned. A worker that dies is reported by the next step (or, mid-step, by
the collective, which fails when its peer's connection closes, else after `parallel_state.TIMEOUT`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed import parallel_state
from tokenmill.executor.abstract import load_configured_model
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.loader import LoadedModel
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rank(config: EngineConfig, rank: int, size: int, init_method: str) -> LoadedModel:
    """Join the group and load this rank's shard of the model (`size`: the world, tp * pp ranks)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:  # each rank its own share of the cores (the runner then uses that many threads)
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= size:
            share = len(cores) // size
            os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])
    p = config.parallel
    parallel_state.init_model_parallel(rank, p.tensor_parallel_size, p.pipeline_parallel_size, init_method, device,
                                       p.pipeline_layer_partition)
    loaded = load_configured_model(config)
    if p.pipeline_parallel_size > 1 and not hasattr(loaded.model.model, "stage_layers"):
        raise ValueError(f"--pipeline-parallel-size: {type(loaded.model).__name__} does not split into pipeline "
                         "stages yet (Llama-family and DeepSeek models do)")
    return loaded


def serve_rank(config: EngineConfig, rank: int, init_method: str) -> None:
    """A worker rank (a process or a Ray actor): load its shard, then run what the driver sends until
    told to stop; a failure is logged and ends the process (the driver sees a dead rank)."""
    from tokenmill.executor.pipeline import serve_pipeline_stage

    try:
        runner = ModelRunner(_start_rank(config, rank, config.parallel.world_size, init_method), config)
        if config.parallel.pipeline_parallel_size > 1:
            serve_pipeline_stage(runner)
        else:
            _serve_tensor_parallel(runner)
    except Exception:  # noqa: BLE001 - a worker's failure is logged here; the driver sees it as a dead rank
        logger.exception("rank %d failed", rank)
        os._exit(1)
    parallel_state.destroy_tensor_parallel()


def _serve_tensor_parallel(runner: ModelRunner) -> None:
    """Run whatever the driver broadcasts until told to stop."""
    while True:
        kind, payload = parallel_state.broadcast_object()
        if kind == "step":
            runner.execute(payload)
        elif kind == "kv":
            runner.initialize_kv_cache(payload)
            runner.warm_up()
        elif kind == "stop":
            break


def _worker(config: EngineConfig, rank: int, init_method: str) -> None:
    """Worker process entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s [rank{rank}] %(message)s")
    parent = multiprocessing.parent_process()

    def watch_parent() -> None:  # an orphaned worker would otherwise wait in a collective
        while parent is None or parent.is_alive():
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    serve_rank(config, rank, init_method)


class WorkerProcesses:
    """Ranks 1..world-1 as processes spawned here."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=_worker, args=(config, rank, init_method), daemon=True,
                                          name=f"tokenmill-rank{rank}") for rank in range(1, config.parallel.world_size)]
        for w in self.processes:
            w.start()

    def dead(self) -> list[str]:
        """How each rank that is gone ended."""
        return [f"rank {rank} exited (code {w.exitcode})" for rank, w in enumerate(self.processes, 1) if not w.is_alive()]

    def stop(self) -> None:
        """Wait a little for the ranks to exit (they were asked to), then kill them."""
        for w in self.processes:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()


def start_workers(config: EngineConfig, init_method: str):
    """The worker ranks, as `--distributed-executor-backend` asks."""
    if config.parallel.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_workers import RayWorkers

        return RayWorkers(config, init_method)
    return WorkerProcesses(config, init_method)


class MultiprocExecutor(UniProcExecutor):
    """The driver: rank 0's runner here (as `UniProcExecutor` runs it), every step shared with the workers first."""

    def __init__(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.workers = start_workers(config, init_method)
        try:
            loaded = _start_rank(config, 0, config.parallel.world_size, init_method)
        except BaseException:  # the workers fail the same way, or wait: stop them
            self._stop_workers()
            raise
        super().__init__(config, loaded)

    def check_health(self) -> None:
        dead = self.workers.dead()
        if dead:
            kind = "pipeline-parallel" if self.config.parallel.pipeline_parallel_size > 1 else "tensor-parallel"
            raise RuntimeError(f"{kind} worker " + ", ".join(dead) + "; the engine cannot run without it")

    def _share(self, kind: str, payload: object = None) -> None:
        self.check_health()
        parallel_state.broadcast_object((kind, payload))

    def close(self) -> None:
        """Stop the workers: asked to, then killed if they do not exit."""
        try:
            self._share("stop")
        except Exception:  # noqa: BLE001 - a dead rank: the others are killed below
            pass
        self._stop_workers()

    def _stop_workers(self) -> None:
        self.workers.stop()
        parallel_state.destroy_tensor_parallel()
