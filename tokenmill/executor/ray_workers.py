"""`RayWorkers`: the worker ranks of a tensor-, pipeline- or context-parallel engine as Ray actors
(`--distributed-executor-backend ray`), one per bundle of a placement group (a CPU each, or a GPU
each on CUDA), on a local Ray cluster this process starts on 127.0.0.1 unless Ray is already
initialized here. The ranks still meet over torch.distributed on 127.0.0.1; each actor runs
`worker_process.serve_rank`, as a worker process would, and a rank that dies ends its actor's task,
which `dead` reports."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.config import EngineConfig

_STARTUP_TIMEOUT = 120.0  # seconds for the placement group to be placed


def _import_ray():
    # a single-node cluster: Ray's node address (and so every server it starts) is 127.0.0.1, not the
    # host's network address; read when ray is first imported
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "--distributed-executor-backend ray needs the ray package (pip install 'tokenmill[ray]')"
        ) from None
    return ray


def _start_local_ray(ray, num_cpus: int) -> None:
    """A local Ray cluster on 127.0.0.1 (never another address; `_import_ray` keeps its servers there);
    its workers import tokenmill from here."""
    if ray.is_initialized():
        return
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    except Exception as e:  # noqa: BLE001 - the reason, said for this option
        raise RuntimeError(f"--distributed-executor-backend ray: cannot start a local Ray cluster: {e}") from e


class RayWorkers:
    """Ranks 1..world-1 as Ray actors."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, gpu = config.parallel.world_size, config.device.startswith("cuda")
        if gpu:  # rank r takes GPU r as a worker process would (the driver has GPU 0): Ray must not hide GPUs
            os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        _start_local_ray(ray, max(os.cpu_count() or 1, world))
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([bundle] * (world - 1), strategy="PACK")
        self._remove_group = remove_placement_group
        ready, _ = ray.wait([self.group.ready()], timeout=_STARTUP_TIMEOUT)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"--distributed-executor-backend ray: the local Ray cluster cannot place "
                f"{world - 1} worker(s) of {bundle} each ({ray.available_resources()} available)"
            )
        rank_actor = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(_RankActor)
        self.actors, self.tasks = [], []
        for rank in range(1, world):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank - 1)
            actor = rank_actor.options(scheduling_strategy=strategy).remote()
            self.actors.append(actor)
            self.tasks.append(actor.serve.remote(config, rank, init_method))

    def dead(self) -> list[str]:
        """How each rank that is gone ended (its actor's task finished: it died or stopped)."""
        done, _ = self.ray.wait(self.tasks, num_returns=len(self.tasks), timeout=0)
        reasons = []
        for rank, task in enumerate(self.tasks, 1):
            if task in done:
                try:
                    self.ray.get(task)
                    reasons.append(f"rank {rank} (Ray actor) exited")
                except Exception as e:  # noqa: BLE001 - the actor died: say how
                    reasons.append(f"rank {rank} (Ray actor) exited ({type(e).__name__})")
        return reasons

    def stop(self) -> None:
        """Wait a little for the ranks to exit (they were asked to), then kill their actors."""
        self.ray.wait(self.tasks, num_returns=len(self.tasks), timeout=5)
        for actor in self.actors:
            self.ray.kill(actor)
        self._remove_group(self.group)


class _RankActor:
    """One worker rank."""

    def serve(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from tokenmill.executor.worker_process import serve_rank

        serve_rank(config, rank, init_method)
