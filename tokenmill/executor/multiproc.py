"""`MultiprocExecutor`: tensor parallelism over processes on this host. Rank 0 (the driver) runs in
the engine core's process; ranks 1..N-1 are worker processes (or Ray actors: `ray_workers.py`) that run
`worker_process.serve_rank`. Every rank loads its shard of the model (layers take their share from
`tokenmill.distributed.parallel_state`) and keeps its own model runner with the same request states.
Each step the driver broadcasts the scheduler's output to the workers (one pickled object over the
group) and every rank runs it: the collectives inside the forward pair up, the gathered logits are the
same bits on every rank, so every rank samples the same tokens; the driver's are returned. A worker
that dies is reported by the next step (or, mid-step, by the collective, which fails when its peer's
connection closes, else after `parallel_state.TIMEOUT`).
"""

from __future__ import annotations

import multiprocessing
import socket

from tokenmill.config import EngineConfig
from tokenmill.distributed import parallel_state
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.executor.worker_process import join_and_load, process_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcesses:
    """Ranks 1..world-1 as processes spawned here."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=process_main, args=(config, rank, init_method), daemon=True, name=f"tokenmill-rank{rank}"
            )
            for rank in range(1, config.parallel.world_size)
        ]
        for w in self.processes:
            w.start()

    def dead(self) -> list[str]:
        """How each rank that is gone ended."""
        return [
            f"rank {rank} exited (code {w.exitcode})" for rank, w in enumerate(self.processes, 1) if not w.is_alive()
        ]

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
            loaded = join_and_load(config, 0, init_method)
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
        super().close()
        try:
            self._share("stop")
        except Exception:  # noqa: BLE001 - a dead rank: the others are killed below
            pass
        self._stop_workers()

    def _stop_workers(self) -> None:
        self.workers.stop()
        parallel_state.destroy_tensor_parallel()
