"""The step contract between scheduler, executor and model runner, and the seams around it: KV
cache sizing from per-layer specs, the model registry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import make_core, make_tiny_model, run_core

from tokenmill.attention.kv_spec import AttentionSpec, make_kv_cache_config
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.engine.kv_cache_coordinator import KVCacheCoordinator
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.outputs import ModelRunnerOutput
from tokenmill.engine.request import EngineCoreRequest, Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kernels import paged_attention
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams


def scheduler_with(prompt: list[int], params: SamplingParams, num_blocks: int = 16):
    kv = KVCacheCoordinator([KVCacheManager(num_blocks, 4)])
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64)
    request = Request(EngineCoreRequest("a", prompt, params), params, eos_token_ids={2})
    sched.add(request)
    return sched, kv, request


def test_several_tokens_per_step_stop_at_the_first_that_ends_the_request():
    sched, kv, request = scheduler_with([1, 3, 4], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    step = sched.schedule()
    assert [n.request_id for n in step.new_requests] == ["a"] and step.num_scheduled_tokens == {"a": 3}
    assert step.new_requests[0].block_ids == kv.block_ids("a")
    updates = sched.update_from_output(step, ModelRunnerOutput({"a": [5, 6]}))
    assert request.num_computed_tokens == 3 and request.output_token_ids == [5, 6] and updates[0].status is None

    step = sched.schedule()  # the runner holds "a" now: only what changed is sent
    assert not step.new_requests and [c.request_id for c in step.cached_requests] == ["a"]
    assert step.num_scheduled_tokens == {"a": 2}
    updates = sched.update_from_output(step, ModelRunnerOutput({"a": [8, 7, 9]}))
    assert updates[0].new_token_ids == [8, 7] and updates[0].status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, 6, 8, 7]  # the token after the stop is dropped
    assert kv.num_free_blocks == kv.num_blocks and not sched.requests
    assert sched.schedule().finished_request_ids == {"a"}  # the runner is told to drop its state


def test_max_tokens_cuts_a_multi_token_step():
    sched, _, request = scheduler_with([1, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    step = sched.schedule()
    updates = sched.update_from_output(step, ModelRunnerOutput({"a": [2, 2, 2, 2]}))  # eos ignored
    assert updates[0].new_token_ids == [2, 2, 2] and updates[0].status == RequestStatus.FINISHED_LENGTH


def test_preempted_request_resumes_with_a_whole_new_block_table(tmp_path):
    """Under KV pressure requests give way and come back: the runner gets `resumed` data with the
    full table, and the outputs equal those of a run with room for everyone."""
    make_tiny_model("llama-gqa-untied", tmp_path)
    loaded = load_model(str(tmp_path))
    prompts = [[(5 * i + j) % 256 for j in range(30)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run_core(make_core(str(tmp_path), loaded=loaded), prompts, params)
    core = make_core(str(tmp_path), loaded=loaded, num_blocks=14, block_size=8)
    resumed = []
    got = run_core(
        core,
        prompts,
        params,
        on_step=lambda c: resumed.extend(r.request_id for r in c.last_schedule.cached_requests if r.resumed),
    )
    assert core.scheduler.num_preemptions > 0 and resumed
    assert got == expected
    assert set(core.executor.runner.requests) <= set(core.scheduler._finished_ids)  # told at the next step
    core.step()
    assert not core.executor.runner.requests


def test_kv_cache_is_sized_from_layer_specs():
    full = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    small = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    config = make_kv_cache_config(
        {"l0": full, "l1": small, "l2": full}, CacheConfig(block_size=4, kv_cache_memory_gib=1 / 1024)
    )
    assert [(g.spec, g.layer_names) for g in config.groups] == [(full, ["l0", "l2"]), (small, ["l1"])]
    assert config.bytes_per_block == 4 * (2 * 2 * 8 * 4 * 2 + 2 * 2 * 8 * 2)
    assert config.num_blocks == 2**20 // config.bytes_per_block
    with pytest.raises(ValueError, match="smaller than one KV block"):
        make_kv_cache_config({"l0": full}, CacheConfig(block_size=4, kv_cache_memory_gib=1e-9))


def test_window_layers_get_a_pool_no_larger_than_they_can_use():
    from tokenmill.attention.kv_spec import window_pool_blocks

    full = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    window = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32, sliding_window=64)
    specs = {"l0": window, "l1": window, "l2": full}
    cap = window_pool_blocks(64, 4, max_num_seqs=8, max_num_batched_tokens=32)
    assert cap == 8 * (16 + 2) + 8
    config = make_kv_cache_config(specs, CacheConfig(block_size=4, kv_cache_memory_gib=1 / 1024), 8, 32)
    assert [g.pool for g in config.groups] == [1, 0] and config.pool_windows == [None, 64]
    assert config.pool_blocks[1] == cap and config.total_bytes <= 2**20
    per_block = 4 * 2 * 2 * 8 * 4  # one layer's K and V of one block
    assert config.pool_blocks[0] == (2**20 - cap * 2 * per_block) // per_block  # the rest to the global layers
    explicit = make_kv_cache_config(specs, CacheConfig(block_size=4, num_blocks=100), 8, 32)
    assert explicit.pool_blocks == [100, 100] and explicit.capacity_tokens == 400


def test_bfloat16_kv_cache_under_float32_compute(tmp_path):
    """A cache dtype other than the compute dtype: half the bytes per block, decode still in the compiled
    kernel (which widens the cached values as it reads them), outputs track float32."""
    make_tiny_model("qwen2-bias", tmp_path)
    loaded = load_model(str(tmp_path))
    prompts = [[(7 * i + j) % 256 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref_core = make_core(str(tmp_path), loaded=loaded)
    ref = run_core(ref_core, prompts, params)
    core = make_core(str(tmp_path), loaded=loaded, cache_dtype="bfloat16")
    assert core.executor.runner.kv_caches[0].dtype == torch.bfloat16
    assert core.executor.runner.backend.name == ("cpu-paged" if paged_attention.load() is not None else "torch-sdpa")
    assert core.kv_cache_config.bytes_per_block * 2 == ref_core.kv_cache_config.bytes_per_block
    got = run_core(core, prompts, params)
    agree = sum(x == y for k in ref for x, y in zip(ref[k], got[k])) / sum(len(v) for v in ref.values())
    assert agree > 0.8


def test_model_files_are_imported_only_when_used():
    code = (
        "import sys, tokenmill.config, tokenmill.models.registry as r; "
        "assert 'tokenmill.models.llama' not in sys.modules; "
        "r.model_class('Qwen2ForCausalLM'); assert 'tokenmill.models.llama' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_failing_step_finishes_only_the_request_at_fault(tmp_path):
    """An exception inside a step (fault injected into the real executor on every step that runs "b")
    fails "b" alone with an error, found by retrying the step's requests in halves; "a", in the same
    failed step, goes on; the core keeps serving, and the pool is whole afterwards."""
    make_tiny_model("llama-gqa-untied", tmp_path)
    core = make_core(str(tmp_path), loaded=load_model(str(tmp_path)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    execute, calls = core.executor.execute, []

    def fail_when_b_runs(sched):
        calls.append(sorted(sched.num_scheduled_tokens))
        if "b" in sched.num_scheduled_tokens:
            raise RuntimeError("injected fault")
        return execute(sched)

    core.executor.execute = fail_when_b_runs
    core.add_request(EngineCoreRequest("a", [1, 2, 3], params))
    outs = {o.request_id: o for o in core.step()}
    assert outs["a"].new_token_ids and outs["a"].error is None
    core.add_request(EngineCoreRequest("b", [4, 5, 6], params))
    assert core.step() == []  # the faulty step ran a and b: retried in halves
    assert calls[1] == ["a", "b"]
    outs = {o.request_id: o for o in core.step() + core.step()}  # a alone, then b alone
    assert calls[2:4] == [["a"], ["b"]] and outs["a"].error is None and len(outs["a"].new_token_ids) == 1
    failed = outs["b"]
    assert failed.finish_reason == "abort" and failed.error and failed.error_param is None
    assert "injected" not in failed.error  # internals stay in the log
    a = outs["a"].new_token_ids
    while "a" in core.requests:
        a += [t for o in core.step() for t in o.new_token_ids]
    assert len(a) == 5  # its 6 tokens in all, the first from the first step
    got = run_core(core, [[7, 8, 9]], params)  # later requests are served as usual
    assert len(got["0"]) == 6
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.requests


def _long_prompt_and_then(second: list[int], share: float = 0.5):
    """A 2,000-token prompt prefilling in steps of 512, and `second` arriving after its first step: the
    token counts of the next step."""
    kv = KVCacheCoordinator([KVCacheManager(1024, 4)])
    config = SchedulerConfig(max_num_batched_tokens=512, max_step_ms=0, long_prefill_share=share)
    sched = Scheduler(config, kv, max_model_len=4096)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    long = [5 + i % 1000 for i in range(2000)]
    sched.add(Request(EngineCoreRequest("long", long, params), params, eos_token_ids={2}))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"long": 512}  # alone, it takes the whole budget
    sched.update_from_output(step, ModelRunnerOutput({}))
    sched.add(Request(EngineCoreRequest("second", second, params), params, eos_token_ids={2}))
    return sched.schedule().num_scheduled_tokens


def test_a_long_prompt_leaves_room_for_a_request_that_arrives():
    """A long prompt does not take every step until it is done while another waits: its chunk shrinks to
    its share of the budget, and the newcomer starts in the next step."""
    assert _long_prompt_and_then([7, 8, 9]) == {"long": 256, "second": 3}
    assert _long_prompt_and_then([7, 8, 9], share=1.0) == {"long": 512}  # off: the newcomer waits


def test_a_request_waiting_for_the_long_prompts_prefix_does_not_slow_it():
    """One that will take the long prompt's blocks from the cache when they are done gains nothing from a
    smaller chunk: the long prompt keeps the whole budget."""
    same_start = [5 + i % 1000 for i in range(1200)] + [3, 3]
    assert _long_prompt_and_then(same_start) == {"long": 512}


def test_decodes_are_never_starved_by_a_running_prompt():
    """A short request that started beside a long prompt decodes in every step: the prompt's chunk takes
    what the decodes leave, whether or not anyone waits."""
    kv = KVCacheCoordinator([KVCacheManager(1024, 4)])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_ms=0), kv, max_model_len=4096)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    long = [5 + i % 1000 for i in range(3000)]
    sched.add(Request(EngineCoreRequest("long", long, params), params, eos_token_ids={2}))
    sched.update_from_output(sched.schedule(), ModelRunnerOutput({}))
    sched.add(Request(EngineCoreRequest("short", [7, 8, 9], params), params, eos_token_ids={2}))
    step = sched.schedule()  # it starts beside the prompt's chunk, after the prompt in the running list
    assert step.num_scheduled_tokens == {"long": 256, "short": 3}
    sched.update_from_output(step, ModelRunnerOutput({"short": [5]}))
    for _ in range(3):
        step = sched.schedule()
        assert step.num_scheduled_tokens["short"] == 1 and sum(step.num_scheduled_tokens.values()) == 512, step
        sched.update_from_output(step, ModelRunnerOutput({"short": [5]}))


def test_prompts_share_their_room_while_a_newcomer_waits():
    """Two long prompts running take half the budget between them, not half each: the newcomer starts."""
    kv = KVCacheCoordinator([KVCacheManager(2048, 4)])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_ms=0), kv, max_model_len=4096)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for name, base in (("a", 5), ("b", 2000)):
        sched.add(
            Request(EngineCoreRequest(name, [base + i % 900 for i in range(3000)], params), params, eos_token_ids={2})
        )
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"a": 512}
    sched.update_from_output(step, ModelRunnerOutput({}))
    step = sched.schedule()  # "b" waits: "a" takes half, "b" the rest
    assert step.num_scheduled_tokens == {"a": 256, "b": 256}
    sched.update_from_output(step, ModelRunnerOutput({}))
    sched.add(Request(EngineCoreRequest("new", [3, 4, 5], params), params, eos_token_ids={2}))
    step = sched.schedule()
    prompts = step.num_scheduled_tokens.get("a", 0) + step.num_scheduled_tokens.get("b", 0)
    assert step.num_scheduled_tokens["new"] == 3 and prompts == 256, step.num_scheduled_tokens
