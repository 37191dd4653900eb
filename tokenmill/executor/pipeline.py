"""`PipelineExecutor`: pipeline parallelism (times tensor parallelism) over processes or Ray actors.

Stage s of P holds decoder layers `parallel_state.pp_layers` and is a tensor-parallel group of its
own (global ranks s*N .. s*N+N-1). The driver is rank 0 of stage 0, in the engine core's process.
A step (`submit`): the driver broadcasts it to its stage's other ranks, all of them run the
embedding and stage 0's layers, and each rank sends the step and its hidden state + residual to the
rank with the same tensor-parallel index in the next stage (`parallel_state.send`, non-blocking);
every later stage receives, runs its layers and passes on; the last stage's ranks norm, take the
logits and sample, and its rank 0 sends the `ModelRunnerOutput` back to the driver (`collect`).
Up to P steps are in flight (`max_concurrent_batches`: the engine core's batch queue), and each
stage runs them in order. Only the last stage samples, so the tokens it sampled ride to the other
stages with the next step (their runners append them, as the sampling stage did).
"""

from __future__ import annotations

from collections import deque

import torch.distributed as dist

from tokenmill.attention.kv_spec import KVCacheConfig
from tokenmill.config import EngineConfig
from tokenmill.distributed import parallel_state
from tokenmill.distributed.pipeline import IntermediateTensors
from tokenmill.engine.outputs import ModelRunnerOutput
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.executor.abstract import size_kv_cache
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.kv_transfer.base import check_supported
from tokenmill.loader import open_checkpoint
from tokenmill.loader.source import resolve_model
from tokenmill.worker.model_runner import ModelRunner


def _append_tokens(runner: ModelRunner, tokens: dict[str, list[int]]) -> None:
    """Tokens the last stage sampled, into this stage's request states."""
    for rid, ids in tokens.items():
        if (state := runner.requests.get(rid)) is not None:
            state.output_token_ids.extend(ids)


class _Sender:
    """Sends to the next stage (or the driver) without waiting; keeps each send until it is done."""

    def __init__(self, dst: int) -> None:
        self.dst, self.pending = dst, deque()

    def __call__(self, message: tuple, out: object = None) -> None:
        while self.pending and self.pending[0][0].is_completed():
            self.pending.popleft()
        tensors = list(out) if isinstance(out, IntermediateTensors) else []
        self.pending.extend(parallel_state.send(message, tensors, self.dst))

    def flush(self) -> None:
        """Wait until everything sent has gone."""
        while self.pending:
            self.pending.popleft()[0].wait()


def _gather_kv_specs(runner: ModelRunner) -> dict | None:
    """Every stage's attention-layer specs, merged on the driver (None elsewhere)."""
    specs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(runner.kv_cache_specs(), specs, dst=0)
    return None if specs is None else {name: spec for stage in specs for name, spec in stage.items()}


def serve_pipeline_stage(runner: ModelRunner) -> None:
    """A worker rank of a pipeline: take each message from the driver (stage 0) or the previous stage,
    run it, hand it on to the next stage (or the driver's output to it, from the last) until "stop"."""
    stage, stages, index = parallel_state.pp_rank(), parallel_state.pp_size(), parallel_state.tp_rank()
    first, last = stage == 0, stage == stages - 1
    _gather_kv_specs(runner)
    send = _Sender(0 if last else parallel_state.global_rank(stage + 1, index))
    while True:
        if first:
            (kind, payload), inputs = parallel_state.broadcast_object(), []
        else:
            (kind, payload), inputs = parallel_state.recv(parallel_state.global_rank(stage - 1, index))
        out = None
        if kind == "kv":
            runner.initialize_kv_cache(payload)
        elif kind == "experts":  # every stage adds its MoE layers' counts on the way to the driver
            payload = {**payload, **runner.expert_load()}
        elif kind == "step":
            sched, tokens = payload
            if not last:
                _append_tokens(runner, tokens)
            out = runner.execute(sched, IntermediateTensors(*inputs) if inputs else None)
        if not last:
            send((kind, payload), out)
        elif kind == "step" and index == 0:
            send(("output", out))
        elif kind == "experts" and index == 0:
            send(("experts", payload))
        if kind == "stop":
            send.flush()  # the next stage gets its "stop" before this rank leaves the group
            break


class PipelineExecutor(MultiprocExecutor):
    """The driver of a pipeline: stage 0's rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        check_supported(config)  # KV transfer (--kv-role) moves one process's cache: refused before workers start
        p = config.parallel  # a layout that does not fit the model fails before any worker starts
        layers = open_checkpoint(resolve_model(config.model)).config.num_hidden_layers
        parallel_state.layer_partition(layers, p.pipeline_parallel_size, p.pipeline_layer_partition)
        super().__init__(config)
        self.max_concurrent_batches = p.pipeline_parallel_size
        self._last = parallel_state.global_rank(p.pipeline_parallel_size - 1)
        self._send = _Sender(parallel_state.global_rank(1))
        self._specs = _gather_kv_specs(self.runner)
        self._sampled: dict[str, list[int]] = {}  # collected since the last step was sent: for the other stages
        self._in_flight = 0  # steps submitted and not collected yet
        self._expert_tokens: dict[int, list[int]] = {}  # every stage's MoE counts, as last gathered

    def initialize_kv_cache(self) -> KVCacheConfig:
        """Sized over every stage's layers (the same block count in each); each stage allocates its own."""
        kv_config = size_kv_cache(self.config, self._specs)
        self._share("kv", kv_config)
        self.runner.initialize_kv_cache(kv_config)
        for sched in self.runner.warm_up_steps():
            self.execute(sched)
        return kv_config

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        """Run stage 0 of a step here and hand it to the next stage (the result comes with `collect`)."""
        self._share("step", (sched, self._sampled))
        self._sampled = {}
        self._in_flight += 1

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight (waits for the last stage)."""
        self.check_health()
        (_, out), _ = parallel_state.recv(self._last)
        self._in_flight -= 1
        _append_tokens(self.runner, out.sampled_token_ids)
        for rid, ids in out.sampled_token_ids.items():
            self._sampled.setdefault(rid, []).extend(ids)
        return out

    def expert_load(self) -> dict[int, list[int]]:
        """Every stage's MoE counts, by layer: gathered along the pipeline (each stage adds its layers'
        on the way to the last, which answers) when no step is in flight; while steps are, the last
        gathering (the engine reads them fresh when it goes idle)."""
        if self._in_flight == 0:
            self._share("experts", self.runner.expert_load())
            (_, self._expert_tokens), _ = parallel_state.recv(self._last)
        return self._expert_tokens

    def _share(self, kind: str, payload: object = None) -> None:
        """Broadcast to this stage's other ranks, run it here, send it on to stage 1."""
        self.check_health()
        if parallel_state.tp_size() > 1:
            parallel_state.broadcast_object((kind, payload))
        out = self.runner.execute(payload[0]) if kind == "step" else None
        self._send((kind, payload), out)
