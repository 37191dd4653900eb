"""One run on a GPU (under 8 minutes on an H100 / H200): is tokenmill correct there, and how fast is it?

    python benchmarks/gpu_check.py                       # the whole check on cuda
    python benchmarks/gpu_check.py --device cpu --dry-run   # every code path on tiny sizes (CPU: eager only)

(a) correctness: a tiny random Llama in float32 and bfloat16 against transformers on the same device
(logits), then through the engine with CUDA graphs and with --enforce-eager: a ragged batch with chunked
prefill and prefix hits against transformers' greedy continuations (float32: token for token), seeded
sampling (the same tokens alone and in a batch), n-gram speculation with logprobs (the tokens and
logprobs of the run without it; the host-device synchronizations of each of its steps, aiming at one),
the KV tiers over a pool on the device (evicted blocks back from pinned host RAM, a restart from disk),
--cpu-offload-gb and --cpu-moe (dense experts, and a GGUF file's quantized ones on the CPU block kernels)
against the resident model (greedy tokens; on CPU through the same loader plan and placement).
(b) speed: an 8B-shaped Llama (Llama-3-8B's shapes, random bfloat16 weights built on the device; no
download): batch-1 decode in ms per token against the bandwidth floor (weight bytes / the measured
device copy bandwidth), and 64 concurrent requests of 512 prompt / 256 output tokens in output tokens
per second, eager and with CUDA graphs; batch-1 decode with a quarter of the weights streamed from the
host (--cpu-offload-gb) against the time of its copies.
(c) kernels (`gpu_kernels.py`): each fused / tuned Triton kernel against the torch or unfused path it
replaces (error and both times); FlashAttention / FlashInfer against the Triton paged kernel where
installed. On CPU only under TRITON_INTERPRET=1.

A GPU machine may reach no package registry: the script says which modules it lacks and skips what
needs them. It prints one line per check (PASS / FAIL / SKIP) and, with --json, writes them all; the exit
status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

RESULTS: list[dict] = []
REQUEST_IDS = itertools.count()
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
LLAMA_TINY = dict(  # the dry run's stand-in for the 8B shapes
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def report(name: str, status: str, detail: str = "", **values) -> None:
    RESULTS.append(dict(name=name, status=status, detail=detail, **values))
    print(f"{status:4} {name}: {detail}", flush=True)


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- (a) correctness -------------------------------------------------------------------------------


TINY_SHAPE = dict(  # the tiny models' shape, dense and MoE
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.05,
)


def tiny_hf_model(directory: Path, config_class: str = "LlamaConfig", **extra):
    """A random tiny model of `config_class` (+ `extra` fields), written to `directory`."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY_SHAPE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


def engine(
    model, device: str, dtype: str, *, eager: bool, loaded=None, speculative=None, offload=None, cache=None, **scheduler
):
    from tokenmill.config import CacheConfig, EngineConfig, OffloadConfig, SchedulerConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.executor.uniproc import UniProcExecutor

    config = EngineConfig(
        model=str(model),
        dtype=dtype,
        device=device,
        enforce_eager=eager,
        cache=CacheConfig(**{"num_blocks": 256, "block_size": 16, **(cache or {})}),
        scheduler=SchedulerConfig(**scheduler),
        speculative=speculative,
        offload=offload or OffloadConfig(),
    )
    executor = UniProcExecutor(config, loaded)
    executor.initialize_kv_cache()
    return EngineCore(config, executor, set())


def run(core, prompts, params, device: torch.device | None = None) -> tuple[dict, dict]:
    """Run `prompts` to the end: their token ids and logprobs entries, in order. With a CUDA `device`, the
    host-device synchronizations of every step are counted and reported (one per step is the aim)."""
    from tokenmill.engine.request import EngineCoreRequest

    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [str(next(REQUEST_IDS)) for _ in prompts]
    tokens, logprobs = {r: [] for r in ids}, {r: [] for r in ids}
    for r, p, sp in zip(ids, prompts, params):
        core.add_request(EngineCoreRequest(r, list(p), sp))
    syncs = []
    while core.has_unfinished():
        counted, outputs = counted_step(core, device is not None and device.type == "cuda")
        syncs.append(counted)
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            logprobs[o.request_id].extend(o.new_logprobs or [])
    if device is not None and device.type == "cuda":
        report("host-device synchronizations per step (speculative run)", "INFO", f"{syncs}")
    return [tokens[r] for r in ids], [logprobs[r] for r in ids]


def counted_step(core, counting: bool) -> tuple[int, list]:
    """One step, and the synchronizations torch's sync debug mode warned of in it (0 when not counting)."""
    if not counting:
        return 0, core.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outputs = core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), outputs


def check_logits(hf, path: Path, device: torch.device, dtype: str) -> None:
    import numpy as np

    from tokenmill.attention.kv_spec import make_kv_cache_config
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.loader import load_model
    from tokenmill.worker.model_runner import ModelRunner

    torch_dtype = getattr(torch, dtype)
    loaded = load_model(str(path), dtype, device)
    runner = ModelRunner(loaded, EngineConfig(model=str(path), dtype=dtype, device=str(device)))
    runner.initialize_kv_cache(make_kv_cache_config(runner.kv_cache_specs(), CacheConfig(num_blocks=16)))
    ids = list(range(3, 60, 2))
    with torch.inference_mode():
        hidden, _ = runner.forward(np.array(ids), np.array([len(ids)]), np.array([0]), [[list(range(1, 3))]])
        ours = runner.model.compute_logits(hidden).float()
        ref = (
            copy.deepcopy(hf).to(device=device, dtype=torch_dtype)(torch.tensor([ids], device=device)).logits[0].float()
        )
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    tol = 1e-4 if dtype == "float32" else 3e-2
    report(
        f"logits vs transformers ({dtype}, {runner.backend.name})",
        "PASS" if err < tol and agree >= (1.0 if dtype == "float32" else 0.9) else "FAIL",
        f"max error / max |logit| {err:.2e} (limit {tol:.0e}), argmax agreement {agree:.3f}",
        error=err,
        agreement=agree,
    )


def greedy_gap(hf, prompt: list[int], tokens: list[int], device: torch.device) -> float:
    """How far below transformers' best logit our greedy tokens fall, worst position (0: each one is
    transformers' argmax; a few 1e-5 at most: a tie in the random model, read either way)."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return (logits.max(-1).values - chosen).max().item()


def check_engine(hf, path: Path, device: torch.device, eager: bool) -> None:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.sampling_params import SamplingParams

    mode = "eager" if eager else "CUDA graphs" if device.type == "cuda" else "graphs n/a on CPU"
    hf = hf.to(device=device, dtype=torch.float32)
    # chunked prefill (16 tokens a step), then prefix hits: the second wave shares the first's 40 tokens
    shared = [(7 * i) % 251 + 1 for i in range(40)]
    first = [shared + [5, 6, 7]]
    second = [shared + [9] * k for k in (1, 5, 17)] + [[3, 1, 4, 1, 5], [2] * 30]
    core = engine(path, str(device), "float32", eager=eager, max_num_batched_tokens=16, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = run(core, first, greedy)[0] + run(core, second, greedy)[0]
    gaps = [greedy_gap(hf, p, g, device) for p, g in zip(first + second, got)]
    same = sum(gap < 1e-4 for gap in gaps)
    report(
        f"ragged batch, chunked prefill, prefix hits vs transformers greedy ({mode})",
        "PASS" if same == len(gaps) and core.kv.prefix_hits >= 3 * 32 else "FAIL",
        f"{same}/{len(gaps)} requests transformers' argmax at every token (worst gap {max(gaps):.1e}), "
        f"{core.kv.prefix_hits} prompt tokens from the prefix cache",
    )
    # seeded sampling: alone and in a batch, the same tokens
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(core, [second[1]], seeded)[0][0]
    batched = run(core, second[:3], [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), seeded, greedy])[
        0
    ][1]
    report(f"seeded sampling alone = in a batch ({mode})", "PASS" if alone == batched else "FAIL", f"{alone[:6]}...")
    # n-gram speculation with logprobs: the same tokens and logprobs as without
    repetitive = [[1, 2, 3, 4, 5, 6] * 6, [9, 8, 7, 9, 8, 7, 9, 8] * 4]
    with_lp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    plain_tokens, plain_lp = run(core, repetitive, with_lp)
    spec = engine(
        path,
        str(device),
        "float32",
        eager=eager,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    spec_tokens, spec_lp = run(spec, repetitive, with_lp, device=device)
    worst = max(
        abs(a[t].logprob - b[t].logprob) for ra, rb in zip(plain_lp, spec_lp) for a, b in zip(ra, rb) for t in a
    )
    report(
        f"n-gram speculation with logprobs = without ({mode})",
        "PASS" if spec_tokens == plain_tokens and worst < 1e-4 else "FAIL",
        f"tokens {'equal' if spec_tokens == plain_tokens else 'differ'}, worst logprob difference {worst:.1e}",
    )
    for c in (core, spec):
        c.executor.close()


def check_tiers(path: Path, device: torch.device) -> None:
    """The KV cache's tiers with the pool on the device: a pool of 8 blocks, so a second prompt evicts the
    first's blocks into the host-RAM tier (pinned on CUDA, copied on a stream of its own), which gives them
    back; then a new engine on the same --kv-cache-dir loads the first prompt from disk. Greedy tokens as
    a run with neither (graphs on where they apply)."""
    from tokenmill.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, second = list(range(5, 90)), list(range(150, 235))[::-1]  # 5 full blocks each
    plain = engine(path, str(device), "float32", eager=False)
    want = run(plain, [first, second, first], greedy)[0]
    plain.executor.close()
    tiers = {"kv_cache_dir": str(path / "kv"), "kv_offloading_size_gib": 2**-10, "kv_disk_min_load_tokens": 16}
    small = dict(cache=dict(num_blocks=8, **tiers))
    core = engine(path, str(device), "float32", eager=False, **small)
    got = [run(core, [p], greedy)[0][0] for p in (first, second, first)]
    ram = core.stats().kv_tiers["ram"]["hits"]
    core.executor.close()  # its disk writes finish
    restarted = engine(path, str(device), "float32", eager=False, **small)
    again = run(restarted, [first], greedy)[0][0]
    disk = restarted.stats().kv_tiers["disk"]["hits"]
    restarted.executor.close()
    report(
        "KV tiers: evicted blocks from host RAM, a restart from disk = no tiers",
        "PASS" if got == want and again == want[0] and ram >= 32 and disk >= 64 else "FAIL",
        f"tokens {'equal' if got == want and again == want[0] else 'differ'}; {ram:.0f} prompt tokens from RAM, "
        f"{disk:.0f} from disk after the restart",
    )


def tiny_moe_model(directory: Path):
    return tiny_hf_model(directory, "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)


def hybrid_engine(model, device: torch.device, offload, loaded=None):
    """An engine whose weights sit as `offload` places them (loaded by the plan: the host's weights built
    there, never on the device). On CUDA the engine's own path; on CPU (the dry run), where the config
    refuses the flags, the same loader plan and `apply_offload` on an engine built without them."""
    from tokenmill.loader import load_model
    from tokenmill.worker.offload import apply_offload, host_placement_planner

    if device.type == "cuda":
        return engine(model, str(device), "float32", eager=True, offload=offload)
    loaded = load_model(str(model), "float32", device, plan_host=host_placement_planner(offload))
    core = engine(model, str(device), "float32", eager=True, loaded=loaded)
    runner = core.executor.runner
    runner.streamed_layers = apply_offload(runner.model, offload, device, loaded.host)
    return core


def check_hybrid(path: Path, device: torch.device) -> None:
    """--cpu-offload-gb (every layer streamed), --cpu-moe (dense experts, and a GGUF file's Q8_0 / Q4_0
    experts on the CPU block kernels) give the greedy tokens of the model without."""
    from tokenmill.config import OffloadConfig
    from tokenmill.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [(5 * i) % 251 + 1 for i in range(40)]]
    moe = path / "moe"
    moe_hf = tiny_moe_model(moe)
    cases = [
        ("--cpu-offload-gb (every layer streamed)", path, OffloadConfig(cpu_offload_gb=1.0)),
        ("--cpu-moe", moe, OffloadConfig(cpu_moe=True)),
    ]
    if missing("gguf"):
        report("--cpu-moe, GGUF experts on the CPU block kernels", "SKIP", "needs gguf (to write the file)")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import write_tiny_gguf

        write_tiny_gguf(
            moe_hf, path / "moe.gguf", {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"}
        )
        cases.append(
            ("--cpu-moe, GGUF experts on the CPU block kernels", path / "moe.gguf", OffloadConfig(cpu_moe=True))
        )
    for name, model, offload in cases:
        plain = engine(model, str(device), "float32", eager=True)
        hybrid = hybrid_engine(model, device, offload)
        runner = hybrid.executor.runner
        placed = (
            runner.streamed_layers is not None if offload.cpu_offload_gb else "forward" in vars(runner.moe_layers[0])
        )
        want, got = run(plain, prompts, greedy)[0], run(hybrid, prompts, greedy)[0]
        report(
            f"{name} = resident",
            "PASS" if want == got and placed else "FAIL",
            f"{got[0][:6]}... vs {want[0][:6]}...{'' if placed else ' (nothing was placed on the host)'}",
        )
        for c in (plain, hybrid):
            c.executor.close()


def correctness(args) -> None:
    lacking = missing("transformers", "safetensors")
    if lacking:
        report("correctness", "SKIP", f"needs {', '.join(lacking)}")
        return
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf = tiny_hf_model(path)
        for dtype in ("float32", "bfloat16"):
            check_logits(hf, path, device, dtype)
        for eager in (True, False) if device.type == "cuda" else (True,):
            check_engine(hf, path, device, eager)
        check_tiers(path, device)
        check_hybrid(path, device)


# ---- (b) speed -------------------------------------------------------------------------------------


def random_llama(shape: dict, device: torch.device, offload=None):
    """A Llama of `shape` with random bfloat16 weights made on the device (no checkpoint); with `offload`
    (an `OffloadConfig`), the weights it keeps on the host made there, as the loader's plan places them."""
    from tokenmill.layers.host_placement import NOTHING
    from tokenmill.loader import LoadedModel, build_model
    from tokenmill.loader.source import ModelSource
    from tokenmill.models.registry import config_from_hf_dict
    from tokenmill.quantization.unquantized import UnquantizedConfig
    from tokenmill.worker.offload import host_placement_planner

    config = config_from_hf_dict(dict(shape, architectures=["LlamaForCausalLM"], model_type="llama"))
    host = NOTHING
    if offload is not None:
        host = host_placement_planner(offload)(
            build_model(config, UnquantizedConfig(), torch.bfloat16, torch.device("meta"))
        )
    net = build_model(config, UnquantizedConfig(), torch.bfloat16, device, host=host)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.02)
        for module in net.modules():
            if hasattr(module, "quant_method"):
                module.quant_method.process_after_loading(module)
    net.eval()
    source = ModelSource("hf", Path("random"), "random-llama")
    return LoadedModel(net, config, source, torch.bfloat16, device, "none", host)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second the device moves in a copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def speed_engine(loaded, device: torch.device, eager: bool, dry: bool, offload=None):
    from tokenmill.config import CacheConfig, EngineConfig, OffloadConfig, SchedulerConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.executor.uniproc import UniProcExecutor

    cache = CacheConfig(gpu_memory_utilization=0.85) if device.type == "cuda" else CacheConfig(num_blocks=512)
    config = EngineConfig(
        device=str(device),
        dtype="bfloat16",
        enforce_eager=eager,
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512 if dry else 8192, max_model_len=1024),
        offload=offload or OffloadConfig(),
    )
    executor = UniProcExecutor(config, loaded)
    kv = executor.initialize_kv_cache()
    return EngineCore(config, executor, set()), kv


def timed_steps(core, device, count_syncs: int = 0) -> list[float]:
    """Each step's seconds; on CUDA, the host-device synchronizations of the `count_syncs` steps after the
    first are counted (torch's sync debug mode warns at each) and reported."""
    times, syncs = [], []
    while core.has_unfinished():
        counting = device.type == "cuda" and 0 < len(times) <= count_syncs
        start = time.perf_counter()
        counted, _ = counted_step(core, counting)
        sync(device)
        times.append(time.perf_counter() - start)
        if counting:
            syncs.append(counted)
    if syncs:
        report("host-device synchronizations per decode step", "INFO", f"{syncs} (the sampled ids' copy is one)")
    return times


def speed(args) -> None:
    from tokenmill.engine.request import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    device = torch.device(args.device)
    dry = args.dry_run
    gc.collect()  # the correctness engines' caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start = time.perf_counter()
    loaded = random_llama(LLAMA_TINY if dry else LLAMA_8B, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = copy_bandwidth(device, 2**26 if dry else 2**30)
    floor_ms = weight_bytes / bandwidth * 1e3
    report(
        "8B-shaped model" if not dry else "8B stand-in (dry run)",
        "INFO",
        f"{weight_bytes / 2**30:.2f} GiB of weights built in {time.perf_counter() - start:.1f}s; copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; decode floor {floor_ms:.2f} ms/token",
        weight_bytes=weight_bytes,
        bandwidth=bandwidth,
        floor_ms=floor_ms,
    )
    decode_tokens, prompt_len, out_len, concurrent = (8, 32, 8, 8) if dry else (128, 512, 256, 64)
    rng = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    resident_ms = 0.0
    for eager in (True, False) if device.type == "cuda" else (True,):
        mode = "eager" if eager else "CUDA graphs"
        t0 = time.perf_counter()
        core, kv = speed_engine(loaded, device, eager, dry)
        setup = time.perf_counter() - t0
        # batch 1
        prompt = torch.randint(0, vocab, (128,), generator=rng).tolist()
        core.add_request(
            EngineCoreRequest("b1", prompt, SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True))
        )
        steps = timed_steps(core, device, count_syncs=3)
        ms = statistics.median(steps[1:]) * 1e3
        if eager:
            resident_ms = ms  # what the offloaded run (eager too) compares with
        report(
            f"batch-1 decode ({mode})",
            "INFO",
            f"{ms:.2f} ms/token = {floor_ms / ms:.0%} of the bandwidth floor ({kv.capacity_tokens} KV tokens, "
            f"engine ready in {setup:.1f}s)",
            ms_per_token=ms,
            floor_fraction=floor_ms / ms,
        )
        # concurrent
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        for i in range(concurrent):
            core.add_request(
                EngineCoreRequest(f"c{i}", torch.randint(0, vocab, (prompt_len,), generator=rng).tolist(), params)
            )
        start = time.perf_counter()
        timed_steps(core, device)
        elapsed = time.perf_counter() - start
        report(
            f"{concurrent} x {prompt_len}-in/{out_len}-out ({mode})",
            "INFO",
            f"{concurrent * out_len / elapsed:.0f} output tok/s ({elapsed:.1f}s)",
            output_tokens_per_s=concurrent * out_len / elapsed,
        )
        core.executor.close()
        del core
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del loaded  # the offloaded run builds its own model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    offload_speed(LLAMA_TINY if dry else LLAMA_8B, device, weight_bytes, resident_ms)


def host_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second from pinned host memory to the device."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return 3 * nbytes / (time.perf_counter() - start)


def offload_speed(shape: dict, device: torch.device, weight_bytes: int, resident_ms: float) -> None:
    """Batch-1 decode with a quarter of the weights streamed from the host (--cpu-offload-gb: a model
    built with those layers in host memory, as the loader's plan does), against the resident run and the
    floor of the copies (offloaded bytes / pinned host-to-device bandwidth). On CPU (the dry run) the same
    plan and streaming, placed on an engine built without the flag (the config refuses it there)."""
    from tokenmill.config import OffloadConfig
    from tokenmill.engine.request import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.offload import apply_offload

    gib = weight_bytes / (4 if device.type == "cuda" else 2) / 2**30  # the dry run's: one of its two layers
    offload = OffloadConfig(cpu_offload_gb=gib)
    loaded = random_llama(shape, device, offload)
    on_device = sum(p.nbytes for p in loaded.model.parameters() if p.device == device)
    if device.type == "cuda":
        core, _ = speed_engine(loaded, device, True, False, offload)
    else:
        core, _ = speed_engine(loaded, device, True, True)
        runner = core.executor.runner
        runner.streamed_layers = apply_offload(runner.model, offload, device, loaded.host)
    streamed = core.executor.runner.streamed_layers
    if streamed is None:
        report(f"batch-1 decode, --cpu-offload-gb {gib:.2f}", "FAIL", "no layer was placed on the host")
        return
    copy_ms = streamed.bytes / host_bandwidth(device, 2**30) * 1e3 if device.type == "cuda" else None
    core.add_request(EngineCoreRequest("off", list(range(128)), SamplingParams(max_tokens=32, temperature=0)))
    ms = statistics.median(timed_steps(core, device)[1:]) * 1e3
    copies = f"; copying them takes {copy_ms:.2f} ms a token at the measured pinned bandwidth" if copy_ms else ""
    report(
        f"batch-1 decode, --cpu-offload-gb {gib:.2f} (eager)",
        "INFO",
        f"{ms:.2f} ms/token vs {resident_ms:.2f} resident; layers {sorted(loaded.host.layers)} "
        f"({streamed.bytes / 2**30:.2f} GiB) built in host memory, {on_device / 2**30:.2f} GiB of weights on the "
        f"device at load{copies}",
        ms_per_token=ms,
        copy_floor_ms=copy_ms,
    )
    core.executor.close()


def kernels(args) -> None:
    from gpu_kernels import kernels as run_kernels  # beside this script

    run_kernels(args, report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu with --dry-run (default: cuda)")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes: every code path in seconds, the speed numbers meaningless"
    )
    parser.add_argument("--skip-correctness", action="store_true", help="skip (a), the correctness checks")
    parser.add_argument("--skip-speed", action="store_true", help="skip (b), the 8B-shaped speed runs")
    parser.add_argument("--skip-kernels", action="store_true", help="skip (c), the kernel comparisons")
    parser.add_argument("--json", metavar="PATH", help="write every result here as JSON (default: only printed)")
    args = parser.parse_args()
    # what importing the engine takes (its loaders' modules, even for weights built on the device), and
    # Triton on CUDA; the correctness section also needs transformers
    lacking = missing(
        "numpy", "safetensors", "gguf", "tqdm", "yaml", *(["triton"] if args.device.startswith("cuda") else [])
    )
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        report("device", "SKIP", "CUDA is not available here (use --device cpu --dry-run)")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report("device", "INFO", f"{name}; torch {torch.__version__}; missing: {', '.join(lacking) or 'nothing'}")
    if lacking:
        report("all", "SKIP", f"needs {', '.join(lacking)} (pure-Python wheels can travel with the tree: PYTHONPATH)")
        return 0
    start = time.perf_counter()
    for section, skip in ((correctness, args.skip_correctness), (speed, args.skip_speed), (kernels, args.skip_kernels)):
        if skip:
            continue
        try:
            section(args)
        except Exception as e:  # one section's failure is reported, the other still runs
            import traceback

            traceback.print_exc()
            report(section.__name__, "FAIL", f"{type(e).__name__}: {e}")
    report("total", "INFO", f"{time.perf_counter() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))
    return 1 if any(r["status"] == "FAIL" for r in RESULTS) else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
