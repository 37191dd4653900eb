"""Context parallelism over two real processes (gloo on 127.0.0.1): each sequence's KV cache striped by
token over the ranks, attention merged by log-sum-exp. Greedy tokens identical to one process, prompt and
output logprobs within 1e-4 of transformers float32, prompts several times one rank's share (and
prefilled in chunks after cached tokens), prefix-cache hits, a sliding-window model, an MLA model, with
and without tensor parallelism sharing the ranks, the ranks as Ray actors, each rank's KV bytes per
token half of one process's, the pool whole after; a MoE model's expert counters count every token once
(summed over the ranks); the disk tier stores each rank's stripe of a block and loads it back after the
pool forgot it; `tokenmill info` shows the per-rank bytes; layouts not built are refused by name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from helpers import assert_same_greedy, greedy_reference, make_core, make_tiny_model, run_core

from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.cli import build_parser
from tokenmill.sampling_params import SamplingParams

LONG = [(7 * i + 3) % 256 for i in range(70)]  # 5 blocks of 16: 35 tokens a rank
PROMPTS = [LONG, [3, 4, 200, 17, 9]]
SHARED = LONG[:48] + [5, 6, 7]  # run after the others: its first 3 blocks come from the prefix cache
TOKENS = 6

# (id, tiny model, tensor-parallel size, decode CP size, prefill CP size, max tokens per step, more settings)
JOBS = [
    ("llama-gqa-untied", "llama-gqa-untied", 1, 2, 1, 512, {}),  # GQA, decode CP on whole-model ranks
    ("gemma3", "gemma3", 1, 1, 2, 32, {}),  # window 8 and full layers, prompts split over the ranks, 32-token chunks
    ("deepseek-v2", "deepseek-v2", 2, 2, 1, 512, {}),  # MLA, the ranks shared with tensor parallelism
    # MoE: each token counted once in the expert counters; each rank's stripe of a block on disk
    ("mixtral", "mixtral", 1, 2, 2, 32, {"disk": True}),
    ("ray", "llama-gqa-untied", 1, 2, 2, 32, {"distributed_executor_backend": "ray"}),  # the ranks as Ray actors
]
if importlib.util.find_spec("ray") is None:  # the [ray] extra is not installed
    JOBS = [job for job in JOBS if job[0] != "ray"]

# one driver process runs every job (it joins a process group: not in the test process)
_RUN = r"""
import json, sys
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.distributed import parallel_state
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

jobs, prompts, shared, tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])

def run(core, batch, tag, **extra):
    out, logprobs, prompt_logprobs = {}, {}, {}
    for i, p in enumerate(batch):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)
        core.add_request(EngineCoreRequest(f"{tag}{i}", p, params))
    while core.has_unfinished():
        for o in core.step():
            i = o.request_id[len(tag):]
            out.setdefault(i, []).extend(o.new_token_ids)
            logprobs.setdefault(i, []).extend(next(iter(e.values())).logprob for e in o.new_logprobs or [])
            if o.prompt_logprobs:  # each entry's first: the prompt token's own
                prompt_logprobs[i] = [None if e is None else next(iter(e.values())).logprob for e in o.prompt_logprobs]
    return out, logprobs, prompt_logprobs

for model, tp, dcp, pcp, chunk, more in jobs:
    disk = more.pop("disk", None)
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=64, kv_cache_dir=disk, kv_disk_min_load_tokens=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
                          parallel=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                                  prefill_context_parallel_size=pcp, **more))
    executor = executor_for(config)
    core = EngineCore(config, executor, set())
    parallel_state.stats.__init__()
    first = run(core, prompts, "a", logprobs=0, prompt_logprobs=0)
    gathered = dict(parallel_state.stats.bytes)
    before = core.kv.prefix_hits
    second = run(core, [shared], "b")
    result = {"tokens": first[0], "logprobs": first[1], "prompt_logprobs": first[2], "shared": second[0],
              "prefix_hits": core.kv.prefix_hits - before, "experts": core.stats().expert_tokens,
              "kv_bytes_per_token": core.kv_cache_config.bytes_per_token, "comm_bytes": gathered}
    if disk:  # the pool forgets every prefix: the blocks come back from each rank's files
        core.reset_prefix_cache()
        result["from_disk"] = run(core, prompts, "c")[0]
        result["disk_hits"] = core.stats().kv_tiers["disk"]["hits"]
    result["pool_whole"] = core.kv.num_free_blocks == core.kv.num_blocks
    executor.close()
    print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """tiny model name -> (directory, the transformers model)."""
    root = tmp_path_factory.mktemp("cp")
    return {name: (str(root / name), make_tiny_model(name, root / name)) for name in {job[1] for job in JOBS}}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    """Each job's outputs from the context-parallel engine (one driver process for all)."""
    disk = str(tmp_path_factory.mktemp("cp-disk-tier"))
    jobs = [
        (models[name][0], tp, dcp, pcp, chunk, {**more, "disk": disk} if more.get("disk") else more)
        for _, name, tp, dcp, pcp, chunk, more in JOBS
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(jobs), json.dumps(PROMPTS), json.dumps(SHARED), str(TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(out) == len(JOBS), done.stdout[-3000:]
    return dict(zip([j[0] for j in JOBS], out))


@pytest.mark.parametrize("job", JOBS, ids=[j[0] for j in JOBS])
def test_same_tokens_as_one_process_and_logprobs_of_transformers(job, models, results):
    job_id, name, _, _, _, chunk, _ = job
    directory, hf = models[name]
    got = results[job_id]
    core = make_core(directory, num_blocks=64, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    one = run_core(core, PROMPTS, params)
    assert [got["tokens"][str(i)] for i in range(len(PROMPTS))] == [one[str(i)] for i in range(len(PROMPTS))]
    assert got["shared"]["0"] == run_core(core, [SHARED], params)["0"]
    assert got["prefix_hits"] >= 48 and got["pool_whole"]
    # MoE: the counters summed over the ranks count every token once, as one process does
    assert {int(layer): sum(c) for layer, c in got["experts"].items()} == {
        layer: sum(c) for layer, c in core.stats().expert_tokens.items()
    }
    if "disk_hits" in got:  # every full block of both prompts loaded from the ranks' files
        assert got["from_disk"] == got["tokens"]
        assert got["disk_hits"] == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    # each rank stores half of every token's K/V
    assert got["kv_bytes_per_token"] * 2 == core.kv_cache_config.bytes_per_token
    assert got["comm_bytes"]["cp_all_gather"] > 0
    for i, prompt in enumerate(PROMPTS):
        ref, ref_logits = greedy_reference(hf, prompt, TOKENS)
        assert_same_greedy(got["tokens"][str(i)], ref, ref_logits)
        chosen = torch.stack([torch.log_softmax(s, -1)[t] for s, t in zip(ref_logits, ref)])
        torch.testing.assert_close(torch.tensor(got["logprobs"][str(i)]), chosen, rtol=0, atol=1e-4)
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
        scored = torch.tensor(got["prompt_logprobs"][str(i)][1:])
        want = full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(scored, want, rtol=0, atol=1e-4)


def test_info_shows_each_ranks_kv_bytes(models, capsys):
    directory = models["deepseek-v2"][0]
    shown = {}
    for extra in ([], ["--decode-context-parallel-size", "2"]):
        args = build_parser("info").parse_args(["info", "--model", directory, *extra])
        args.func(args)
        shown[len(extra)] = capsys.readouterr().out
    whole = int(shown[0].split("KV bytes per token ")[1].split()[0])
    per_rank = int(shown[2].split("KV bytes per token per rank ")[1].split()[0])
    assert per_rank * 2 == whole and "per rank" not in shown[0]


def test_layouts_not_built_are_refused_by_name():
    for kwargs, flag in [
        (dict(decode_context_parallel_size=2, prefill_context_parallel_size=4), "--prefill-context-parallel-size 4"),
        (dict(tensor_parallel_size=2, prefill_context_parallel_size=2), "--tensor-parallel-size 2"),
        (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "--tensor-parallel-size 2"),
        (dict(pipeline_parallel_size=2, decode_context_parallel_size=2), "--pipeline-parallel-size"),
        (dict(decode_context_parallel_size=0), "decode_context_parallel_size must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=flag):
            ParallelConfig(**kwargs)
    cp = ParallelConfig(decode_context_parallel_size=2)
    for kwargs, flag in [
        (dict(cache=CacheConfig(block_size=15)), "--block-size 15"),
        (dict(cache=CacheConfig(cache_dtype="int8")), "--kv-cache-dtype"),
        (dict(speculative=SpeculativeConfig(method="ngram")), "--speculative-config"),
    ]:
        with pytest.raises(ValueError, match=flag):
            EngineConfig(parallel=cp, **kwargs)
    assert EngineArgs().create_engine_config().parallel.world_size == 1
    assert (
        EngineArgs.from_kwargs("LLM", prefill_context_parallel_size=2).create_engine_config().parallel.world_size == 2
    )
    flags = build_parser().parse_args(["generate", "--prompt", "x", "--decode-context-parallel-size", "2"])
    parallel = EngineArgs.from_cli_args(flags).create_engine_config().parallel
    assert (parallel.decode_context_parallel_size, parallel.world_size) == (2, 2)
