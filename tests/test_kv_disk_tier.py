"""The KV cache's disk tier (`--kv-cache-dir`) and host-RAM tier (`--kv-offloading-size`) with real engine
cores on tiny random models: a prompt's blocks written by one engine are loaded by another whose pool
never saw them, with greedy tokens identical to a cold run (float32 and int8 caches); salts and models
do not share blocks; a truncated, corrupt or foreign file is a miss and is removed; a size limit evicts
the least recently used blocks, and one smaller than a block, or a full disk, turns writing off without
failing a request; a KV dtype or block size of its own finds no blocks. Blocks evicted from a small pool are loaded back from the RAM tier, then the disk tier, with
the cold run's tokens; a block leaving a full RAM tier goes on to disk. Pools are whole after."""

from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest
from helpers import make_tiny_model

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import UniProcExecutor
from tokenmill.kv_transfer.block_files import SUFFIX
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import ServerMetrics

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 90))  # 85 tokens: 5 full blocks, the last token always computed
SHARING = PROMPT[: 3 * BLOCK] + [200, 201, 202, 203, 204]  # its first 3 blocks are PROMPT's
OTHER = list(range(150, 235))[::-1] + [1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas differing only in their weights."""
    dirs = []
    for i, std in enumerate((0.02, 0.03)):
        directory = tmp_path_factory.mktemp(f"tiny-disk-tier-{i}")
        make_tiny_model("llama-gqa-untied", directory, initializer_range=std)
        dirs.append(directory)
    return dirs


def engine(
    model_dir,
    cache_dir=None,
    cache_dtype="auto",
    disk_gib=1.0,
    min_load=BLOCK,
    ram_gib=None,
    num_blocks=48,
    lora=None,
    block_size=BLOCK,
) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            cache_dtype=cache_dtype,
            kv_cache_dir=None if cache_dir is None else str(cache_dir),
            kv_disk_size_gib=disk_gib,
            kv_disk_min_load_tokens=min_load,
            kv_offloading_size_gib=ram_gib,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
        lora=lora,
    )
    return EngineCore(config, UniProcExecutor(config, load_model(str(model_dir))), set())


def run(core: EngineCore, prompts, salt=None, params=GREEDY, tier="disk") -> tuple[dict, dict]:
    """Greedy outputs and the tier's counters (the engine runs until its writes are reported); the
    pool is whole afterwards."""
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, params, cache_salt=salt))
        out[str(i)] = []
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return out, core.stats().kv_tiers.get(tier, {})


def files(cache_dir) -> list:
    """The tier's files, most recently used first (a prompt's blocks: in prompt order)."""
    return sorted(cache_dir.glob(f"*{SUFFIX}"), key=os.path.getmtime, reverse=True)


def again(core: EngineCore, prompts, salt=None) -> tuple[dict, dict]:
    """`run` once more on an engine whose pool forgot every prefix: only the tier can supply them."""
    core.reset_prefix_cache()
    return run(core, prompts, salt)


@pytest.fixture(scope="module")
def cold(models):
    """Greedy outputs of every prompt here without the tier, by (model, KV cache dtype)."""
    return {
        (i, dtype): run(engine(models[i], cache_dtype=dtype), [PROMPT, SHARING, OTHER])[0]
        for i, dtype in ((0, "auto"), (0, "int8"))
    }


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_disk_hits_give_the_cold_run_tokens(models, cold, tmp_path, cache_dtype):
    core = engine(models[0], tmp_path, cache_dtype)
    _, saved = run(core, [PROMPT])
    assert len(files(tmp_path)) == saved["saved_blocks"] == 5
    got, disk = again(core, [PROMPT, SHARING])
    assert got == {k: v for k, v in cold[0, cache_dtype].items() if k != "2"}
    assert (disk["hits"], disk["loads"], disk["bad_files"]) == (5 * BLOCK + 3 * BLOCK, 2, 0)
    assert len(files(tmp_path)) == 5  # SHARING has no block of its own; nothing written twice
    core.kv_connector.min_load_tokens = 6 * BLOCK  # a shorter hit is recomputed
    _, more = again(core, [PROMPT])
    assert (more["hits"], more["loads"], more["recomputes"]) == (disk["hits"], 2, 1)


def test_salts_and_models_do_not_share_blocks(models, tmp_path):
    run(engine(models[0], tmp_path), [PROMPT], salt="alice")
    other_model = engine(models[1], tmp_path)
    for salt in ("alice", None):
        assert again(other_model, [PROMPT], salt=salt)[1]["hits"] == 0
    core = engine(models[0], tmp_path)
    for salt in ("bob", None):
        assert again(core, [PROMPT], salt=salt)[1]["hits"] == 0
    assert again(core, [PROMPT], salt="alice")[1]["hits"] == 5 * BLOCK


def test_a_kv_dtype_or_block_size_of_its_own_finds_no_blocks(models, tmp_path):
    """Both are in the blocks' keys: a server started with another one on the same directory computes."""
    run(engine(models[0], tmp_path), [PROMPT])
    assert again(engine(models[0], tmp_path, "int8"), [PROMPT])[1]["hits"] == 0
    assert again(engine(models[0], tmp_path, block_size=2 * BLOCK), [PROMPT])[1]["hits"] == 0
    assert again(engine(models[0], tmp_path), [PROMPT])[1]["hits"] == 5 * BLOCK


def test_bad_files_are_misses_and_removed(models, cold, tmp_path, caplog):
    core = engine(models[0], tmp_path)
    run(core, [PROMPT])
    blocks = files(tmp_path)
    data = bytearray(blocks[2].read_bytes())
    data[len(data) // 2] ^= 0xFF
    blocks[2].write_bytes(data)  # corrupt
    with caplog.at_level(logging.WARNING):
        got, disk = again(core, [PROMPT])
    assert got["0"] == cold[0, "auto"]["0"] and (disk["hits"], disk["bad_files"]) == (2 * BLOCK, 1)
    assert "checksum mismatch" in caplog.text  # removed, then written again by that run
    blocks[1].write_bytes(blocks[1].read_bytes()[:-7])  # truncated
    shutil.copy(blocks[4], blocks[3])  # block 4's file under block 3's name: foreign
    got, disk = again(core, [PROMPT])
    assert got["0"] == cold[0, "auto"]["0"] and (disk["hits"], disk["bad_files"]) == (3 * BLOCK, 2)
    got, disk = again(core, [PROMPT])
    assert got["0"] == cold[0, "auto"]["0"] and (disk["hits"], disk["bad_files"]) == (6 * BLOCK, 3)
    assert "another block's file" in caplog.text or disk["bad_files"] == 3


def test_a_size_limit_evicts_the_least_recently_used_blocks_tails_first(models, cold, tmp_path, caplog):
    _, disk = run(engine(models[0], tmp_path), [PROMPT])
    limit = 3.5 * disk["usage_bytes"] / 5
    core = engine(models[0], tmp_path, disk_gib=limit / (1 << 30))
    _, disk = run(core, [OTHER])
    assert disk["usage_bytes"] <= limit and len(files(tmp_path)) == 3 and disk["evicted_blocks"] == 7
    assert again(core, [OTHER])[1]["hits"] == 3 * BLOCK  # its first 3 blocks stayed: a tail goes before its head
    with caplog.at_level(logging.WARNING):  # a limit smaller than one block: no tier, the requests still run
        got, disk = run(engine(models[0], tmp_path / "tiny", disk_gib=1e-9), [PROMPT, SHARING, OTHER])
    assert (
        got == cold[0, "auto"] and disk["errors"] == 1 and disk["dropped_blocks"] == 5 + 5 - 1
    )  # SHARING's blocks are PROMPT's
    assert "writing is off" in caplog.text and not files(tmp_path / "tiny")


def test_a_full_disk_turns_writing_off_and_the_requests_go_on(models, cold, tmp_path, caplog, monkeypatch):
    real_replace = os.replace

    def full_disk(src, dst):  # a block file's rename fails as on a full file system; others go through
        if str(dst).endswith(SUFFIX):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    with caplog.at_level(logging.WARNING):
        got, disk = run(engine(models[0], tmp_path), [PROMPT, SHARING, OTHER])
    assert got == cold[0, "auto"] and disk["errors"] == 1 and disk["saved_blocks"] == 0
    assert "is full" in caplog.text and not files(tmp_path) and not list(tmp_path.glob("*.tmp"))


def test_a_sliding_window_model_loads_every_pool_of_its_blocks(tmp_path):
    """Gemma 3 (window 8, one full-attention layer): its window pool returns a prompt's early blocks
    while the later chunks are computed, so each block is saved in the step that fills it."""
    make_tiny_model("gemma3", tmp_path / "model")
    cold = run(engine(tmp_path / "model"), [PROMPT, SHARING])[0]
    core = engine(tmp_path / "model", tmp_path / "tier")
    assert len(core.kv.managers) == 2
    _, saved = run(core, [PROMPT])
    assert saved["saved_blocks"] == 5
    got, disk = again(core, [PROMPT, SHARING])
    assert got == cold and (disk["hits"], disk["bad_files"]) == (5 * BLOCK + 3 * BLOCK, 0)


def test_lora_requests_neither_load_nor_write_the_base_models_blocks(models, tmp_path):
    """The disk tier's keys name no adapter (a load id does not outlive the server): a LoRA request
    whose prompt the base model stored computes it, and stores nothing."""
    import transformers
    from helpers import make_lora_adapter

    from tokenmill.config import LoRAConfig

    base = transformers.AutoModelForCausalLM.from_pretrained(models[0])
    make_lora_adapter(base, tmp_path / "a", 1, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"])
    lora = LoRAConfig({"a": str(tmp_path / "a")}, max_loras=1, max_lora_rank=8)
    adapted = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name="a")
    run(engine(models[0], tmp_path / "tier"), [PROMPT])
    got, disk = run(engine(models[0], tmp_path / "tier", lora=lora), [PROMPT], params=adapted)
    assert got == run(engine(models[0], lora=lora), [PROMPT], params=adapted)[0]
    assert (disk["hits"], disk["saved_blocks"], len(files(tmp_path / "tier"))) == (0, 0, 5)


def test_info_shows_bytes_per_token_by_tier_and_where_the_weights_live(models, capsys):
    from tokenmill.entrypoints.cli import main

    main(["info", "--model", str(models[0]), "--load"])
    rows = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in capsys.readouterr().out.splitlines())}
    per_token = rows["KV bytes per token"].split()[0]
    assert rows["KV bytes per token by tier"].startswith(f"pool {per_token}, disk {per_token} + ")
    mapped, copied = (float(x) for x in rows["weights mapped / copied"].split(" MiB")[0].split(" / "))
    assert mapped > 0 and copied > 0  # whole float32 tensors from the file's map; fused layers copied
    assert rows["resident memory after load"].endswith("MiB")


def test_layouts_the_tier_does_not_run_with_are_refused_naming_the_flags(tmp_path):
    from tokenmill.config import ParallelConfig
    from tokenmill.kv_transfer.base import check_supported
    from tokenmill.kv_transfer.config import KVTransferConfig

    cache = CacheConfig(kv_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--kv-cache-dir needs --pipeline-parallel-size 1"):
        check_supported(EngineConfig(cache=cache, parallel=ParallelConfig(pipeline_parallel_size=2)))
    check_supported(EngineConfig(cache=cache, parallel=ParallelConfig(tensor_parallel_size=2)))
    with pytest.raises(ValueError, match="--kv-cache-dir does not run with --kv-role"):
        check_supported(EngineConfig(cache=cache, kv_transfer=KVTransferConfig("consumer", "SharedMemoryConnector")))
    with pytest.raises(ValueError, match="kv_disk_size must be >= 0"):
        CacheConfig(kv_disk_size_gib=-1)


SLOT = 8192 / (1 << 30)  # GiB of one block of the tiny Llama's float32 cache (2 layers x K/V x 16 x 2 x 32)


def test_blocks_evicted_from_the_pool_come_back_from_the_ram_tier(models, cold):
    """A pool of 8 blocks: OTHER takes the blocks PROMPT left, evicting PROMPT's blocks 2-4 (a tail
    goes first) into the RAM tier; PROMPT again hits blocks 0-1 in the pool, 2-4 in RAM."""
    core = engine(models[0], ram_gib=16 * SLOT, num_blocks=8)
    assert core.kv_connector.block_bytes == 8192  # SLOT is one block
    run(core, [PROMPT], tier="ram")
    assert run(core, [OTHER], tier="ram")[0]["0"] == cold[0, "auto"]["2"]
    got, ram = run(core, [PROMPT], tier="ram")
    assert got["0"] == cold[0, "auto"]["0"]
    assert (ram["hits"], ram["loads"], ram["saved_blocks"]) == (3 * BLOCK, 1, 6)  # then OTHER's 3 were evicted
    metrics = ServerMetrics("tiny")
    metrics.on_stats({"kv_tiers": core.stats().kv_tiers})
    assert f'tokenmill:kv_tier_hits_total{{model_name="tiny",tier="ram"}} {3.0 * BLOCK}' in metrics.render().decode()


def test_a_small_ram_tier_hands_on_to_the_disk_tier(models, cold, tmp_path):
    """Two slots in RAM in front of the disk tier: PROMPT's block 4 left RAM for blocks 3 and 2, so
    PROMPT again takes blocks 2-3 from RAM and 4 from disk. Blocks of generated tokens (not written
    when the prompt was computed) reach the disk when they leave RAM: a new engine on the directory
    loads a next turn's prompt (the first turn's prompt + answer) through them."""
    core = engine(models[0], tmp_path / "tier", ram_gib=2 * SLOT, num_blocks=8)
    run(core, [PROMPT])
    _, ram = run(core, [OTHER], tier="ram")
    assert ram["evicted_blocks"] == 1 and ram["usage_bytes"] == ram["capacity_bytes"] == 2 * 8192
    got, ram = run(core, [PROMPT], tier="ram")
    assert got["0"] == cold[0, "auto"]["0"]
    assert (ram["hits"], core.stats().kv_tiers["disk"]["hits"]) == (2 * BLOCK, BLOCK)

    turn = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = list(range(100, 140))  # 2 full prompt blocks; the answer fills blocks 2 and 3
    core = engine(models[0], tmp_path / "turns", ram_gib=2 * SLOT, num_blocks=8)
    answer = run(core, [first], params=turn)[0]["0"]
    assert len(files(tmp_path / "turns")) == 2
    run(core, [OTHER])
    run(core, [PROMPT])  # the answer's blocks go pool -> RAM -> disk
    assert len(files(tmp_path / "turns")) == 2 + 5 + 5 + 2
    following = first + answer + [7, 8, 9, 10, 11]
    got, disk = run(engine(models[0], tmp_path / "turns"), [following])
    assert got["0"] == run(engine(models[0]), [following])[0]["0"] and disk["hits"] == 4 * BLOCK


def test_what_the_ram_tier_does_not_run_with_is_refused_naming_the_flags(models, tmp_path):
    from tokenmill.config import ParallelConfig
    from tokenmill.engine.kv_cache_coordinator import KVCacheCoordinator
    from tokenmill.engine.kv_cache_manager import KVCacheManager
    from tokenmill.kv_transfer.base import check_supported
    from tokenmill.kv_transfer.host_tier import host_tier_scheduler

    cache = CacheConfig(kv_offloading_size_gib=1.0)
    with pytest.raises(ValueError, match="--kv-offloading-size needs --pipeline-parallel-size 1"):
        check_supported(EngineConfig(cache=cache, parallel=ParallelConfig(pipeline_parallel_size=2)))
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        check_supported(EngineConfig(cache=CacheConfig(kv_offloading_size_gib=1.0, enable_prefix_caching=False)))
    with pytest.raises(ValueError, match="kv_offloading_size must be > 0"):
        CacheConfig(kv_offloading_size_gib=0)
    windowed = KVCacheCoordinator([KVCacheManager(8, BLOCK), KVCacheManager(8, BLOCK, sliding_window=32)])
    with pytest.raises(ValueError, match="--kv-offloading-size needs a model whose layers share one KV pool"):
        host_tier_scheduler(EngineConfig(cache=cache), windowed, None)
    with pytest.raises(ValueError, match="--kv-offloading-size 1e-09 GiB holds no KV block"):
        engine(models[0], ram_gib=1e-9)


@pytest.mark.parametrize("ram_gib", [None, 16 * SLOT])
def test_a_failed_step_leaves_no_write_waited_for(models, cold, tmp_path, ram_gib):
    """A step whose forward raises (a prompt token outside the vocabulary, slipped past validation)
    while PROMPT's prompt completes in it: the blocks named to save never reach the writer, and the
    engine must not wait for them (it goes idle); PROMPT still gets its tokens and its blocks saved."""
    core = engine(models[0], tmp_path, ram_gib=ram_gib)
    core.add_request(EngineCoreRequest("good", PROMPT[:40], GREEDY))
    core.add_request(EngineCoreRequest("bad", [5, 6, 7], GREEDY))
    core.requests["bad"].prompt_token_ids[1] = 10**6
    out: dict[str, list] = {"good": [], "bad": []}
    for _ in range(200):
        if not core.has_unfinished():
            break
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert not core.has_unfinished() and core.kv.num_free_blocks == core.kv.num_blocks
    assert out["good"] == run(engine(models[0]), [PROMPT[:40]])[0]["0"] and len(files(tmp_path)) == 2
