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
import sys

from tokenmill.config import EngineConfig
from tokenmill.distributed import parallel_state
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.executor.worker_process import (
    STARTED,
    context_parallel_expert_load,
    join_and_load,
    process_main,
    rank_failure,
)
from tokenmill.ports import free_port


class WorkerProcesses:
    """Ranks 1..world-1 as processes spawned here, each with a pipe on which it reports (`process_main`)."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes, self.reports, ends = [], [], []
        for rank in range(1, config.parallel.world_size):
            report, end = context.Pipe(duplex=False)
            self.processes.append(
                context.Process(
                    target=process_main,
                    args=(config, rank, init_method, end),
                    daemon=True,
                    name=f"tokenmill-rank{rank}",
                )
            )
            self.reports.append(report)
            ends.append(end)
        for w in self.processes:
            w.start()
        for end in ends:  # the ranks hold them now
            end.close()
        self._said: list[list[str]] = [[] for _ in self.processes]

    def dead(self) -> list[str]:
        """How each rank that is gone ended: its error if it reported one, the likely cause if it died
        before it started."""
        gone = []
        for rank, (w, report, said) in enumerate(zip(self.processes, self.reports, self._said), 1):
            if w.is_alive():
                continue
            try:
                while report.poll():
                    said.append(report.recv())
            except (EOFError, OSError):
                pass
            if not said:
                gone.append(f"rank {rank} exited (code {w.exitcode}) before it started: {_rerun_hint()}")
            elif said[-1] != STARTED:
                gone.append(f"rank {rank} failed: {said[-1]}")
            else:
                gone.append(f"rank {rank} exited (code {w.exitcode})")
        return gone

    def stop(self) -> None:
        """Wait a little for the ranks to exit (they were asked to), then kill them."""
        for w in self.processes:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()


def _rerun_hint() -> str:
    """Why a spawned rank dies before it starts: it first runs the main script again."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (
        f"a spawned rank first runs {script} again, so a script that creates a parallel engine (e.g. "
        "LLM(..., tensor_parallel_size=2)) when it is run fails there; put that code under "
        '`if __name__ == "__main__":` (the rank\'s own error is printed above)'
    )


def start_workers(config: EngineConfig, init_method: str):
    """The worker ranks, as `--distributed-executor-backend` asks."""
    if config.parallel.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_workers import RayWorkers

        return RayWorkers(config, init_method)
    return WorkerProcesses(config, init_method)


class MultiprocExecutor(UniProcExecutor):
    """The driver: rank 0's runner here (as `UniProcExecutor` runs it), every step shared with the workers first."""

    def __init__(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.workers = start_workers(config, init_method)
        try:
            loaded = join_and_load(config, 0, init_method, self.workers.dead)
        except BaseException:  # the workers fail the same way, or wait: stop them
            self._stop_workers()
            raise
        super().__init__(config, loaded)

    def expert_load(self) -> dict[int, list[int]]:
        if self.config.parallel.context_parallel_size == 1:
            return super().expert_load()
        self._share("experts")
        return context_parallel_expert_load(self.runner)

    def check_health(self) -> None:
        dead = self.workers.dead()
        if dead:
            raise RuntimeError(rank_failure(self.config, dead))

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
