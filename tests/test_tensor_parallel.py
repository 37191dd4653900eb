"""Tensor parallelism over two real processes (gloo on 127.0.0.1): greedy output token-identical to
one process — dense HF checkpoints (GQA, MQA with its one kv head replicated and a tied head,
sliding windows and q/k norms, biases, a vocabulary that does not divide by the ranks) and GGUF
blocks split by rows and by whole blocks of columns, in both modes — models that cannot split
are refused with a clear error, and a served engine whose worker dies says so and comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest
import torch
from helpers import assert_greedy_of, make_core, make_tiny_model, run_core, write_tiny_gguf
from test_server_utils import model_available, running_server

from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 70, 101, 7], [3, 4, 200], list(range(10, 60))]  # the last spans blocks and windows
TOKENS = 12

# run the engine core with --tensor-parallel-size N in a fresh process (the driver binds itself to
# its share of the cores and joins a process group: not in the test process), one job after another:
# a module's models share one driver process, whose start and imports (~4 s) each job paid alone
_RUN = r"""
import json, sys
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

jobs, size, prompts, tokens = json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
for model, dtype, mode in jobs:
    config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig(num_blocks=64),
                          parallel=ParallelConfig(tensor_parallel_size=size, enable_expert_parallel=mode == "ep"))
    executor = executor_for(config)
    core = EngineCore(config, executor, set())
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
        out[str(i)] = []
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert core.kv.num_free_blocks == core.kv.num_blocks, "KV blocks leaked"
    stats = core.stats()
    executor.close()
    print("RESULT " + json.dumps({"tokens": [out[str(i)] for i in range(len(prompts))],
                                  "stats": {"expert_tokens": stats.expert_tokens,
                                            "moe_rank_tokens": stats.moe_rank_tokens}}), flush=True)
"""


def run_parallel(jobs: list[tuple[str, str, str]], size: int = 2) -> subprocess.CompletedProcess:
    """One driver process running each of `jobs` (model, dtype, mode) in turn; mode "ep": with
    --enable-expert-parallel."""
    return subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(jobs), str(size), json.dumps(PROMPTS), str(TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def parallel_runs(jobs: list[tuple[str, str, str]]) -> list[tuple[list[list[int]], dict]]:
    """(greedy tokens of each prompt, the engine's routing statistics at the end) of each job."""
    done = run_parallel(jobs)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(jobs), done.stdout[-3000:]
    return [(r["tokens"], r["stats"]) for r in results]


def single_tokens(model: str, dtype: str = "float32") -> list[list[int]]:
    core = make_core(model, num_blocks=64, loaded=load_model(model, dtype=dtype))
    out = run_core(core, PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    return [out[str(i)] for i in range(len(PROMPTS))]


TWO_RANK_MODELS = {
    "llama-gqa-untied": {},
    "llama-mqa-tied": {},  # 1 kv head on 2 ranks: replicated; the head shares the split embedding
    "gemma3": {},  # sliding windows, q/k norms, scaled embedding
    "qwen2-bias": {"vocab_size": 251},  # q/k/v biases; 126 + 125 vocabulary rows
}
GGUF_DTYPES = ["float32", "auto"]  # the exact mode's float kernel; int8 activations
CT_VARIANTS = ["mixed", "w8a16-channel-asym"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every checkpoint this module compares with one process, with its two-rank greedy run (all in one
    driver process): key -> (path, dtype, transformers model or None, tokens)."""
    from test_compressed_tensors import write_checkpoint

    cases = {}
    for name, overrides in TWO_RANK_MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        cases[name] = (str(directory), "float32", make_tiny_model(name, directory, **overrides))
    hf = make_tiny_model("llama-gqa-untied", tmp_path_factory.mktemp("gguf-hf"))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    # o_proj (64 columns) and down_proj (128) are split by columns: 32 and 64 per rank, whole blocks
    write_tiny_gguf(
        hf,
        path,
        {
            "attn_q": "Q8_0",
            "attn_k": "Q4_0",
            "attn_v": "Q4_1",
            "attn_output": "Q4_0",
            "ffn_gate": "Q8_0",
            "ffn_up": "Q4_1",
            "ffn_down": "Q8_0",
            "output": "Q8_0",
        },
    )
    for dtype in GGUF_DTYPES:
        cases[f"gguf-{dtype}"] = (str(path), dtype, None)
    for variant in CT_VARIANTS:
        directory = tmp_path_factory.mktemp(f"ct-{variant}")
        write_checkpoint(make_tiny_model("llama-gqa-untied", directory / "hf"), directory / "ct", variant)
        cases[f"ct-{variant}"] = (str(directory / "ct"), "float32", None)
    runs = parallel_runs([(path, dtype, "tp") for path, dtype, _ in cases.values()])
    return {key: (*case, tokens) for (key, case), (tokens, _) in zip(cases.items(), runs)}


@pytest.mark.parametrize("name", TWO_RANK_MODELS)
def test_two_ranks_give_the_greedy_tokens_of_one(two_rank_runs, name):
    path, _, hf, ours = two_rank_runs[name]
    assert ours == single_tokens(path)
    for prompt, tokens in zip(PROMPTS, ours):  # and so transformers' (the tie rule)
        assert_greedy_of(hf, prompt, tokens, TOKENS)


@pytest.mark.parametrize("dtype", GGUF_DTYPES)
def test_gguf_blocks_split_by_rows_and_by_whole_blocks_of_columns(two_rank_runs, dtype):
    path, _, _, ours = two_rank_runs[f"gguf-{dtype}"]
    assert ours == single_tokens(path, dtype)


@pytest.mark.parametrize("variant", CT_VARIANTS)
def test_compressed_tensors_layers_split_by_rows_and_columns(two_rank_runs, variant):
    """fp8 per channel (attention), MXFP4 (MLP), a dense down projection; int8 per channel with zero
    points: o_proj and down_proj split by columns, 32 and 64 per rank (per-channel scales repeat per
    block of the split)."""
    path, _, _, ours = two_rank_runs[f"ct-{variant}"]
    assert ours == single_tokens(path)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_k_quant_columns_split_inside_super_blocks(qtype, int8_activations):
    """768 columns over 2 ranks: 384 each, which cuts a 256-value super-block; each rank folds the
    super-block factors into float32 block scales, and the ranks' partial products sum to the whole."""
    from test_quantization import q8_reference, random_gguf_tensor

    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.quantization.gguf import GGUFConfig

    weight, ref = random_gguf_tensor(qtype, 48, 768, np.random.default_rng(3))
    x = torch.randn(5, 768)
    total = torch.zeros(5, 48)
    for rank in range(2):
        layer = RowParallelLinear(
            768, 48, quant_config=GGUFConfig({"w.weight": qtype}, int8_activations), prefix="w", tp_rank=rank, tp_size=2
        )
        layer.weight_loader("weight", weight)
        assert layer.scales.dtype == torch.float32 and layer.supers is None
        total += layer.quant_method.apply(layer, x[:, rank * 384 : (rank + 1) * 384], None)
    want = q8_reference(x, ref) if int8_activations else x @ ref.T
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_layers_that_cannot_split_are_refused_clearly(tmp_path):
    make_tiny_model("llama-mha", tmp_path / "three", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    done = run_parallel([(str(tmp_path / "three"), "float32", "tp")])
    assert done.returncode != 0
    assert "3 query / 3 kv heads do not split over 2 ranks" in done.stderr


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-llama-tp")
    make_tiny_model("llama-gqa-untied", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    args = (
        "--model",
        str(directory),
        "--served-model-name",
        "tiny-tp",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--log-interval",
        "0",
    )
    yield from running_server(tmp_path_factory, "tp-server", *args)


def _worker_pid(server) -> int:
    """Rank 1: the engine core's child bound to the second half of the cores (the driver has the first)."""
    core = psutil.Process(server.core_pid())
    ranks = [
        c for c in core.children() if c.cpu_affinity() != core.cpu_affinity() and "spawn_main" in " ".join(c.cmdline())
    ]
    assert len(ranks) == 1, [(c.pid, c.cmdline(), c.cpu_affinity()) for c in core.children()]
    return ranks[0].pid


@pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")
def test_served_engine_reports_a_dead_worker_and_recovers(tp_server):
    client = tp_server.openai_client()
    first = client.completions.create(
        model="tiny-tp", prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert first.usage.completion_tokens == 8
    psutil.Process(_worker_pid(tp_server)).kill()
    deadline = time.monotonic() + 30  # the core notices within a second or two, then is restarted
    while httpx.get(f"{tp_server.url}/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "the server still reports healthy with a dead tensor-parallel worker"
        time.sleep(0.2)
    assert "tensor-parallel worker rank 1 exited" in tp_server.log()
    deadline = time.monotonic() + 240
    while httpx.get(f"{tp_server.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server did not come back"
        time.sleep(0.5)
    again = client.completions.create(
        model="tiny-tp", prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == first.choices[0].text  # two fresh ranks, the same greedy answer


# two tensor-parallel LLMs one after the other in one process, the first shut down by its `with`, the
# second by garbage collection: each joins the default process group afresh and leaves no worker behind
_TWO_LLMS = r"""
import gc, json, sys
import torch.distributed as dist
from tokenmill import LLM, SamplingParams

params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
with LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2) as llm:
    first = llm.generate([[1, 5, 9, 33]], params, use_tqdm=False)[0].outputs[0].token_ids
    workers = llm.engine.core.executor.workers.processes
assert not dist.is_initialized() and not any(w.is_alive() for w in workers), "shutdown() left the group or a worker"
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
second = llm.generate([[1, 5, 9, 33]], params, use_tqdm=False)[0].outputs[0].token_ids
workers = llm.engine.core.executor.workers.processes
del llm
gc.collect()
assert not dist.is_initialized() and not any(w.is_alive() for w in workers), "a collected LLM left the group or a worker"
print("TOKENS " + json.dumps([list(first), list(second)]), flush=True)
"""


@pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")
def test_a_second_parallel_llm_in_one_process_after_shutdown(tmp_path, tokenizer):
    make_tiny_model("llama-gqa-untied", tmp_path, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-c", _TWO_LLMS, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS "))
    first, second = json.loads(line[len("TOKENS ") :])
    assert first == second and len(first) == 6


# a script that starts a parallel engine when it is run, with no `if __name__ == "__main__":` guard: the
# spawned rank runs it again while it starts, and dies there
_NO_GUARD = """
from tokenmill import LLM

llm = LLM({model!r}, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
"""


@pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")
def test_a_rank_that_dies_while_starting_is_reported_at_once_with_the_fix(tmp_path, tokenizer):
    """The driver watches its worker processes while it waits at the rendezvous: the rank's death ends
    the wait with the cause and the fix, long before the rendezvous would time out."""
    make_tiny_model("llama-gqa-untied", tmp_path, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(tmp_path)
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_GUARD.format(model=str(tmp_path)))
    timeout = 240  # the rendezvous timeout for this run: without the watch, the driver would wait this long
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        env={**os.environ, "TOKENMILL_DIST_TIMEOUT": str(timeout)},
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert "tensor-parallel worker rank 1 exited" in error and "before it started" in error, done.stderr[-3000:]
    assert str(script) in error and 'if __name__ == "__main__":' in error
    assert elapsed < timeout / 2


# two engines with --tensor-parallel-size 2, one after the other, on one --kv-cache-dir: the second
# loads the first's blocks (each rank its own share of each)
_DISK_TIER_RUN = r"""
import json, sys
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

model, directory, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for run in range(2):
    config = EngineConfig(model=model, dtype="float32", cache=CacheConfig(num_blocks=64, kv_cache_dir=directory),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    executor = executor_for(config)
    core = EngineCore(config, executor, set())
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        out[str(i)] = []
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert core.kv.num_free_blocks == core.kv.num_blocks, "KV blocks leaked"
    disk = core.stats().kv_tiers["disk"]
    executor.close()
    print("RESULT " + json.dumps({"tokens": [out[str(i)] for i in range(len(prompts))], "disk": disk}), flush=True)
"""


def test_the_disk_tier_stores_and_loads_each_ranks_share(tmp_path):
    model = str(tmp_path / "model")
    make_tiny_model("llama-gqa-untied", model)
    prompt = list(range(5, 90))  # 5 full blocks of 16
    prompts = [prompt, prompt[:48] + [200, 201, 202, 203]]  # the second shares 3 blocks
    done = subprocess.run(
        [sys.executable, "-c", _DISK_TIER_RUN, model, str(tmp_path / "tier"), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert first["disk"]["hits"] == 0 and len(list((tmp_path / "tier").glob("*.kv"))) == 2 * 5  # a file per rank
    assert second["tokens"] == first["tokens"]  # the cold run's (two ranks give one's: tested above)
    assert (second["disk"]["hits"], second["disk"]["bad_files"]) == (5 * 16 + 3 * 16, 0)
