"""Pipeline parallelism over real processes (gloo on 127.0.0.1) and the Ray executor backend: greedy
output token-identical to one process with several requests of different lengths in flight at once
(micro-batches overlap in the pipeline) and prompts chunked over steps; an uneven layer partition
under preemption; tensor x pipeline parallelism in Ray actors; the KV pool whole afterwards; bad layouts refused naming the
option; a killed stage reported, not waited on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import make_core, make_tiny_model, run_core

from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.executor import PipelineExecutor
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

# different lengths: some finish while others still prefill; the last spans several 16-token blocks
PROMPTS = [[1, 5, 9, 33, 70, 101, 7], [3, 4, 200], list(range(10, 60)), list(range(100, 131)), [42] * 20]
TOKENS = [12, 5, 9, 14, 3]
BUDGET = 24  # tokens per step: the longer prompts are chunked

# run the engine core with a parallel layout in a fresh process; "kill" kills the last worker after
# two steps and expects the engine to report it
_RUN = r"""
import json, os, signal, sys
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

model, layout, prompts, tokens, budget = sys.argv[1], json.loads(sys.argv[2]), *map(json.loads, sys.argv[3:6])
kill, num_blocks = layout.pop("kill", False), layout.pop("num_blocks", 64)
config = EngineConfig(model=model, dtype="float32", cache=CacheConfig(num_blocks=num_blocks),
                      scheduler=SchedulerConfig(max_num_batched_tokens=budget), parallel=ParallelConfig(**layout))
executor = executor_for(config)
core = EngineCore(config, executor, set())
depth = [0, 0]  # steps in flight now, most at once
if config.parallel.pipeline_parallel_size > 1:
    submit, collect = executor.submit, executor.collect
    def counted_submit(sched):
        depth[0] += 1
        depth[1] = max(depth)
        submit(sched)
    def counted_collect():
        depth[0] -= 1
        return collect()
    executor.submit, executor.collect = counted_submit, counted_collect
out = {}
for i, (p, n) in enumerate(zip(prompts, tokens)):
    core.add_request(EngineCoreRequest(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    out[str(i)] = []
steps = 0
while core.has_unfinished():
    for o in core.step():
        out[o.request_id].extend(o.new_token_ids)
    steps += 1
    if kill and steps == 2:
        import psutil, time
        workers = executor.workers
        if hasattr(workers, "processes"):
            pid = workers.processes[-1].pid
        else:  # the Ray actor's process: a child of this process's raylet
            pid = next(p.pid for p in psutil.Process().children(recursive=True) if "_RankActor" in " ".join(p.cmdline()))
        os.kill(pid, signal.SIGKILL)
        try:
            while core.has_unfinished():  # the steps in flight fail: their requests finish with an error
                core.step()
            for _ in range(300):
                executor.check_health()
                time.sleep(0.1)
        except RuntimeError as e:
            print("HEALTH " + str(e), flush=True)
        executor.close()
        sys.exit(0)
assert core.kv.num_free_blocks == core.kv.num_blocks, "KV blocks leaked"
experts = core.stats().expert_tokens  # MoE models: every stage's layers
executor.close()
print("RESULT " + json.dumps({"tokens": out, "in_flight": depth[1], "preemptions": core.scheduler.num_preemptions,
                              "experts": {str(k): v for k, v in experts.items()}}))
"""


def run_layout(model: str, **layout) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN,
            model,
            json.dumps(layout),
            json.dumps(PROMPTS),
            json.dumps(TOKENS),
            json.dumps(BUDGET),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def layout_result(model: str, **layout) -> dict:
    done = run_layout(model, **layout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A 4-layer Llama (GQA) and its tokens from one process, with the same chunked budget."""
    directory = tmp_path_factory.mktemp("tiny-llama-pp")
    make_tiny_model("llama-gqa-untied", directory, num_hidden_layers=4)
    return str(directory)


@pytest.fixture(scope="module")
def single(tiny) -> list[list[int]]:
    core = make_core(tiny, num_blocks=64, max_num_batched_tokens=BUDGET, loaded=load_model(tiny, dtype="float32"))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in TOKENS]
    out = run_core(core, PROMPTS, params)
    return [out[str(i)] for i in range(len(PROMPTS))]


def _tokens(result: dict) -> list[list[int]]:
    return [result["tokens"][str(i)] for i in range(len(PROMPTS))]


def test_two_stages_give_the_greedy_tokens_of_one_process(tiny, single):
    result = layout_result(tiny, pipeline_parallel_size=2)
    assert _tokens(result) == single
    assert result["in_flight"] == 2  # two micro-batches were in the pipeline at once


def test_uneven_layer_partition_and_preemption(tiny, single):
    """A KV pool too small for every request at once: requests not in flight give way and recompute."""
    result = layout_result(tiny, pipeline_parallel_size=2, pipeline_layer_partition=[1, 3], num_blocks=7)
    assert _tokens(result) == single
    assert result["preemptions"] > 0


def test_two_by_two_ray_actors_give_the_greedy_tokens_of_one_process(tiny, single):
    """TP 2 x PP 2 as Ray actors: each stage's collectives in its own tensor-parallel group."""
    pytest.importorskip("ray")
    result = layout_result(tiny, distributed_executor_backend="ray", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert _tokens(result) == single
    assert result["in_flight"] == 2


def test_moe_expert_counts_cover_every_stage_and_leave_out_the_warm_up(tmp_path):
    """The MoE counters of both stages reach the driver, and count each prompt and output token once per
    layer (as one process does), the warm-up request not at all."""
    directory = tmp_path / "tiny-mixtral"
    make_tiny_model("mixtral", directory, num_hidden_layers=4)
    one, two = layout_result(str(directory)), layout_result(str(directory), pipeline_parallel_size=2)
    assert _tokens(two) == _tokens(one)
    tokens = sum(len(p) + n - 1 for p, n in zip(PROMPTS, TOKENS))  # each fed once: the last output never is
    top_k = 2  # the tiny Mixtral's experts per token
    assert sorted(two["experts"]) == ["0", "1", "2", "3"]
    assert {layer: sum(c) for layer, c in two["experts"].items()} == {str(i): tokens * top_k for i in range(4)}
    assert {layer: sum(c) for layer, c in one["experts"].items()} == {str(i): tokens * top_k for i in range(4)}


@pytest.mark.parametrize(
    "layout,message",
    [
        (dict(pipeline_parallel_size=3), "--pipeline-parallel-size 3 does not divide the model's 4 decoder layers"),
        (
            dict(pipeline_parallel_size=2, pipeline_layer_partition=(1, 2)),
            "--pipeline-layer-partition 1,2 sums to 3, but the model has 4 decoder layers",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_model_are_refused_before_workers_start(tiny, layout, message):
    config = EngineConfig(model=tiny, parallel=ParallelConfig(**layout))
    with pytest.raises(ValueError, match=message):
        PipelineExecutor(config)


def test_kv_transfer_with_a_pipeline_is_refused_before_workers_start(tiny):
    """Each stage holds only its own layers' KV cache, so a transfer cannot move a prompt's KV from one
    process. Before this refusal, a pipelined producer finished its requests without sending their KV
    and a pipelined consumer never admitted the requests it held: they waited forever."""
    for role in ("producer", "consumer"):
        config = EngineConfig(
            model=tiny,
            parallel=ParallelConfig(pipeline_parallel_size=2),
            kv_transfer=KVTransferConfig(role, "SharedMemoryConnector"),
        )
        with pytest.raises(ValueError, match="--kv-role does not run with --pipeline-parallel-size > 1"):
            PipelineExecutor(config)


def test_bad_options_are_refused_naming_them():
    with pytest.raises(
        ValueError, match="--pipeline-layer-partition 2,2 must give a positive number of layers to each of the 3"
    ):
        ParallelConfig(pipeline_parallel_size=3, pipeline_layer_partition=(2, 2))
    with pytest.raises(ValueError, match="--distributed-executor-backend must be 'mp' or 'ray', got 'mpi'"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ParallelConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize(
    "backend,message",
    [
        ("mp", "pipeline-parallel worker rank 1 exited (code -9)"),
        ("ray", "pipeline-parallel worker rank 1 (Ray actor) exited ("),
    ],
)
def test_a_killed_stage_is_reported(tiny, backend, message):
    if backend == "ray":
        pytest.importorskip("ray")
    done = run_layout(tiny, pipeline_parallel_size=2, distributed_executor_backend=backend, kill=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HEALTH " + message in done.stdout, done.stdout + done.stderr[-2000:]
