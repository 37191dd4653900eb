"""The worker side of a parallel engine: what a rank runs, as a process spawned by
`MultiprocExecutor` (`process_main`) or as a Ray actor (`ray_workers.py`), both through `serve_rank`.
The driver (rank 0, in the engine core's process) joins the group with the same `join_and_load`."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed import parallel_state
from tokenmill.executor.abstract import load_target_model
from tokenmill.kv_transfer.base import worker_connector
from tokenmill.loader import LoadedModel
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STARTED = "started"  # what a worker process reports first (`process_main`)


def join_and_load(
    config: EngineConfig, rank: int, init_method: str, watch: Callable[[], list[str]] | None = None
) -> LoadedModel:
    """Join the group (a world of tp * pp ranks) and load this rank's shard of the model. The driver
    passes `watch` (how each worker rank that is gone ended): the rendezvous waits for every rank, so
    one that died first would hold it for `parallel_state.TIMEOUT`; instead the join fails as soon as
    `watch` reports a rank gone, with what it said."""
    device = torch.device(config.device)
    p = config.parallel
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:  # each rank its own share of the cores (the runner then uses that many threads)
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= p.world_size:
            share = len(cores) // p.world_size
            os.sched_setaffinity(0, cores[rank * share : (rank + 1) * share])
    args = (
        rank,
        p.tensor_parallel_size,
        p.pipeline_parallel_size,
        init_method,
        device,
        p.pipeline_layer_partition,
        p.context_parallel_size,
    )
    if watch is None:
        parallel_state.init_model_parallel(*args)
    else:
        _join_watching(lambda: parallel_state.init_model_parallel(*args), watch, config)
    loaded = load_target_model(config)
    if p.pipeline_parallel_size > 1 and not hasattr(loaded.model.model, "stage_layers"):
        raise ValueError(
            f"--pipeline-parallel-size: {type(loaded.model).__name__} does not split into pipeline "
            "stages yet (Llama-family and DeepSeek models do)"
        )
    return loaded


def _join_watching(join: Callable[[], None], watch: Callable[[], list[str]], config: EngineConfig) -> None:
    """Run `join` (the rendezvous) in a thread; fail at once if `watch` reports a worker rank gone. The
    thread is left to end by itself then (at the rendezvous timeout): nothing waits on it."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            join()
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread below
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True, name="tokenmill-rendezvous")
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.1)
        if thread.is_alive() and (dead := watch()):
            raise RuntimeError(rank_failure(config, dead))
    if failure:
        raise failure[0]


def rank_failure(config: EngineConfig, dead: list[str]) -> str:
    """The error of an engine that lost worker ranks (`dead`: how each ended)."""
    p = config.parallel
    kind = "pipeline-parallel" if p.pipeline_parallel_size > 1 else "tensor-parallel"
    if p.context_parallel_size > 1:
        kind = "context-parallel"
    return f"{kind} worker " + "; ".join(dead) + "; the engine cannot run without it"


def serve_rank(config: EngineConfig, rank: int, init_method: str, report: Callable[[str], None] | None = None) -> None:
    """A worker rank (a process or a Ray actor): load its shard, then run what the driver sends until
    told to stop; a failure is logged, told to `report` (the driver shows it) and ends the process."""
    from tokenmill.executor.pipeline import serve_pipeline_stage  # pipeline.py builds on the driver's module

    try:
        runner = ModelRunner(join_and_load(config, rank, init_method), config)
        if config.parallel.pipeline_parallel_size > 1:
            serve_pipeline_stage(runner)
        else:
            _serve_tensor_parallel(runner)
    except Exception as e:  # noqa: BLE001 - a worker's failure is logged here; the driver sees it as a dead rank
        logger.exception("rank %d failed", rank)
        if report is not None:
            report(f"{type(e).__name__}: {e}")
        os._exit(1)
    parallel_state.destroy_tensor_parallel()


def _serve_tensor_parallel(runner: ModelRunner) -> None:
    """Run whatever the driver broadcasts until told to stop; with a KV connector configured (the disk
    tier), this rank's worker half runs around each step, as the driver's does around its own."""
    connector = None
    try:
        while True:
            kind, payload = parallel_state.broadcast_object()
            if kind == "step" and connector is not None:
                connector.execute(payload, runner.execute)
            elif kind == "step":
                runner.execute(payload)
            elif kind == "experts":
                context_parallel_expert_load(runner)
            elif kind == "kv":
                runner.initialize_kv_cache(payload)
                runner.warm_up()
                connector = worker_connector(runner.config, runner)
            elif kind == "stop":
                break
    finally:
        if connector is not None:
            connector.close()


def context_parallel_expert_load(runner: ModelRunner) -> dict[int, list[int]]:
    """The MoE counts summed over the context-parallel ranks (every rank calls it): each rank counts
    the rows it ran of a step split by prefill context parallelism, rank 0 alone a step every rank ran
    whole (`ForwardContext.count_experts`), so the sum counts every token once."""
    counts = runner.expert_load()
    if not counts:  # a dense model: the same on every rank
        return counts
    layers = sorted(counts)
    mine = torch.tensor([counts[layer] for layer in layers], device=runner.device)
    return dict(zip(layers, parallel_state.cp_all_gather(mine).sum(0).tolist()))


def process_main(config: EngineConfig, rank: int, init_method: str, report: Connection) -> None:
    """A worker process's entry point (spawned by `WorkerProcesses`): ends with its parent. It tells
    `report` that it started, and why it failed if it does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s [rank{rank}] %(message)s")
    parent = multiprocessing.parent_process()

    def watch_parent() -> None:  # an orphaned worker would otherwise wait in a collective
        while parent is None or parent.is_alive():
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    report.send(STARTED)
    serve_rank(config, rank, init_method, report.send)
