"""The GPU path's groundwork, checked without a GPU: no tensor in the step's code is made on the CPU by
accident, the KV pool is sized from the device's memory (the device's answers replaced), and the
settings that depend on the device pick the GPU's defaults."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import all_logits, make_tiny_model

from tokenmill.engine_args import CPU_DEFAULTS, CUDA_DEFAULTS, EngineArgs, device_defaults
from tokenmill.sample.rejection_sampler import target_probs
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import memory_profile
from tokenmill.worker.cuda_graphs import capture_sizes, eager_reason, padded_size

ROOT = Path(__file__).resolve().parents[1] / "tokenmill"
# the code a step runs on the device's tensors
STEP_CODE = ["worker", "attention", "sample", "layers/paged_forward.py"]
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye"}


def _undeviced_factories(path: Path) -> list[str]:
    """`torch.<factory>(...)` calls without `device=`, unless a line of the call says `# host` (a tensor
    meant for the host, e.g. xgrammar's bitmask)."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
            marked = any("# host" in line for line in lines[node.lineno - 1 : node.end_lineno])
            if not any(k.arg == "device" for k in node.keywords) and not marked:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: torch.{f.attr}")
    return found


def test_step_code_makes_no_tensor_without_a_device():
    files = [
        p for part in STEP_CODE for p in ((ROOT / part).rglob("*.py") if (ROOT / part).is_dir() else [ROOT / part])
    ]
    found = [hit for path in files for hit in _undeviced_factories(path)]
    assert not found, "tensors made on the CPU by default (pass device=, or mark the line # host):\n" + "\n".join(found)


def test_the_scan_finds_an_undeviced_tensor(tmp_path):
    bad = ROOT / "worker" / "_scan_probe.py"  # inside the package: the scan reports paths relative to it
    try:
        bad.write_text("import torch\nx = torch.full((2,), 1.0)\ny = torch.full((2,), 1.0, device='cpu')\n")
        assert _undeviced_factories(bad) == ["tokenmill/worker/_scan_probe.py:2: torch.full"]
    finally:
        bad.unlink()


def test_rejection_sampler_filters_stay_on_the_logits_device():
    """The meta device stands in for a GPU: a CPU tensor mixed in raises, as it would on CUDA."""
    logits = torch.randn(3, 10, device="meta")
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
    assert target_probs(logits, params).device.type == "meta"


class ScriptedMemory(memory_profile.DeviceMemory):
    """A device of 80 GiB where 1 GiB is in use outside torch, the weights hold 16 GiB, and the
    profile step peaks 3 GiB above them (0.25 GiB of it its scratch KV cache)."""

    GIB = 2**30

    def __init__(self):
        self.steps = []

    def settle(self):
        self.steps.append("settle")

    def reset_peak(self):
        self.steps.append("reset")

    def free_and_total(self):
        return 80 * self.GIB - 17 * self.GIB, 80 * self.GIB

    def allocated(self):
        return 16 * self.GIB

    def peak_allocated(self):
        return 19 * self.GIB


def test_kv_budget_is_what_the_weights_activations_and_other_use_leave():
    memory, ran = ScriptedMemory(), []
    profile = memory_profile.measure(memory, lambda: ran.append(memory.steps[:]) or ScriptedMemory.GIB // 4)
    assert ran == [["settle", "reset"]] and memory.steps[-1] == "settle"  # step between reset and reading
    gib = ScriptedMemory.GIB
    # 0.9 * 80 = 72 GiB; minus 1 outside torch, minus the 19 GiB peak less the 0.25 GiB scratch cache
    assert memory_profile.kv_cache_budget(0.9, profile) == int(0.9 * 80 * gib) - gib - (19 * gib - gib // 4)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.2 .*nothing is left for the KV cache"):
        memory_profile.kv_cache_budget(0.2, profile)


def test_profile_steps_cover_the_largest_batch():
    steps, blocks = memory_profile.profile_steps(num_tokens=100, num_reqs=8, block_size=16, pools=2, max_len=64)
    first, last = steps
    sizes = [len(r.prompt_token_ids) for r in first.new_requests]
    assert sum(sizes) == 100 and len(sizes) == 8 and max(sizes) - min(sizes) <= 1
    assert sum(first.num_scheduled_tokens.values()) == 100
    used = sorted(b for r in first.new_requests for b in r.block_ids[0])
    assert used == list(range(1, blocks)) and all(r.block_ids[1] == r.block_ids[0] for r in first.new_requests)
    assert last.finished_request_ids == set(first.num_scheduled_tokens)
    # one request cannot pass max_len: more requests than asked for
    steps, _ = memory_profile.profile_steps(num_tokens=100, num_reqs=1, block_size=16, pools=1, max_len=40)
    assert [len(r.prompt_token_ids) for r in steps[0].new_requests] == [34, 33, 33]


def test_profile_step_runs_on_a_scratch_cache_and_leaves_the_runner_as_it_was(tmp_path):
    from helpers import make_runner

    from tokenmill.loader import load_model

    make_tiny_model("llama-gqa-untied", tmp_path)
    runner = make_runner(load_model(str(tmp_path)), num_blocks=16)
    ids = [5, 9, 2, 200, 17, 3, 3, 90]
    before = all_logits(runner, ids)
    config = runner.kv_cache_config
    scratch = memory_profile.run_profile_step(runner, 16, num_tokens=70, num_reqs=3, max_len=1024)
    assert scratch > 0 and runner.kv_cache_config is None and not runner.requests
    runner.initialize_kv_cache(config)
    torch.testing.assert_close(all_logits(runner, ids), before, rtol=0, atol=0)


def test_device_defaults():
    assert device_defaults("cpu") == CPU_DEFAULTS
    cuda = device_defaults("cuda:0")
    assert (
        cuda["gpu_memory_utilization"] == 0.9
        and cuda["max_num_batched_tokens"] == CUDA_DEFAULTS["max_num_batched_tokens"]
    )
    assert device_defaults("cuda", sized=True)["gpu_memory_utilization"] is None
    assert device_defaults("cuda", world_size=2)["gpu_memory_utilization"] is None
    config = EngineArgs(model=None).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 512)
    assert config.cache.gpu_memory_utilization is None and config.cache.kv_cache_memory_gib == 1.0
    with pytest.raises(ValueError, match="gpu_memory_utilization sizes the KV cache on CUDA"):
        EngineArgs(model=None, gpu_memory_utilization=0.5).create_engine_config()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(model=None, gpu_memory_utilization=1.5).create_engine_config()
    assert np.isclose(EngineArgs(model=None, kv_cache_memory=2.5).create_engine_config().cache.kv_cache_memory_gib, 2.5)


def test_decode_graph_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 250, 256)] == [1, 4, 8, 16, 256, 256]
    assert padded_size(257, sizes) is None  # eager beyond the largest graph


def test_cuda_settings_never_ask_for_the_cpu_kernels(monkeypatch):
    """On CUDA the weight format, the block-kernel check and the attention backend are chosen by the device
    first: the C++ CPU extension (built from source where no prebuilt variant fits) is never asked for."""
    from tokenmill.attention.selector import get_attention_backend
    from tokenmill.kernels import block_quant, decode_step, fp8_matmul, fused_ops, paged_attention
    from tokenmill.quantization import check_block_kernels, resolve_quantization

    def refuse():
        raise AssertionError("the C++ CPU kernels were asked for on CUDA")

    for module in (block_quant, decode_step, fp8_matmul, fused_ops, paged_attention):
        monkeypatch.setattr(module, "cpu_kernels", refuse)
    cuda = torch.device("cuda")
    assert resolve_quantization("auto", "gguf", cuda, torch.bfloat16) == "none"
    assert resolve_quantization("auto", "hf", cuda, torch.float32, exact=True) == "none"
    check_block_kernels("--quantization int8", cuda, torch.bfloat16)  # Triton's kernel: no CPU one needed
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "auto")
    assert get_attention_backend(cuda, torch.bfloat16, torch.bfloat16).name == "triton-paged"
    with pytest.raises(AssertionError, match="asked for"):  # the CPU still asks: the patch is live
        resolve_quantization("auto", "gguf", torch.device("cpu"), torch.float32)


def test_decode_graphs_apply_unless_a_setting_says_why_not():
    """The gate of `capture_decode_graphs` on a runner standing in for a CUDA one: --enforce-eager turns
    graphs off, and so does each setting whose step the graphs cannot replay, each named."""
    from types import SimpleNamespace

    from tokenmill.config import EngineConfig, ParallelConfig, SpeculativeConfig

    def runner(backend="triton-paged", cache=torch.bfloat16, drafter=None, experts=None):
        return SimpleNamespace(
            device=torch.device("cuda"),
            backend=SimpleNamespace(name=backend),
            kv_cache_config=SimpleNamespace(groups=[SimpleNamespace(spec=SimpleNamespace(dtype=cache))]),
            drafter=drafter,
            moe_layers=[SimpleNamespace(w13=torch.nn.Parameter(torch.empty(0)) if experts is None else experts)],
        )

    def config(**changes):  # an engine config on CUDA, as the runner would have it, with `changes`
        return SimpleNamespace(**vars(EngineConfig()) | changes)

    assert eager_reason(runner(), config()) is None
    assert eager_reason(runner(), config(enforce_eager=True)) == "--enforce-eager"
    assert eager_reason(SimpleNamespace(device=torch.device("cpu")), config()) == "not on CUDA"
    assert "--cpu-moe" in eager_reason(runner(), config(offload=SimpleNamespace(active=True)))
    assert eager_reason(runner(), config(parallel=ParallelConfig(tensor_parallel_size=2))) == "several processes"
    assert eager_reason(runner("torch-sdpa"), config()) == "the torch-sdpa attention backend"
    assert eager_reason(runner(cache=torch.int8), config()) == "a quantized KV cache"
    ngram = config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    assert eager_reason(runner(drafter=object()), ngram) is None  # n-gram drafts on the host
    eagle = config(speculative=SimpleNamespace(method="eagle3"))
    assert eager_reason(runner(drafter=object()), eagle) == "a drafter that reads hidden states"
    assert eager_reason(runner(experts=torch.nn.ModuleList()), config()) == "quantized MoE experts"
