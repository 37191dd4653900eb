"""`tokenmill plan`: model facts from tiny configs against hand computations and the engine's own KV
specs, fit counts, roofline numbers, the command on the default model, and the `--max-model-len auto` fit."""

import json

import pytest
import torch
from helpers import TINY_BASE, TINY_MODELS

from tokenmill.config import CacheConfig
from tokenmill.entrypoints.cli import main
from tokenmill.kernels import block_quant
from tokenmill.layers.attention import Attention
from tokenmill.loader import build_model
from tokenmill.models.registry import config_from_hf_dict
from tokenmill.plan import roofline as rl
from tokenmill.plan.fit import max_model_len_that_fits
from tokenmill.plan.hardware import MEASURED_BY, Hardware, cache_path, this_machine
from tokenmill.plan.model_facts import facts_from_config
from tokenmill.quantization.unquantized import UnquantizedConfig

# plan's name -> the tiny model of tests/helpers.py it reads, and that model's architecture
CONFIGS = {
    "llama-gqa": ("llama-gqa-untied", "LlamaForCausalLM"),
    "mistral-window": ("mistral-window", "MistralForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
    "deepseek-v3": ("deepseek-v3", "DeepseekV3ForCausalLM"),
    "qwen3-moe": ("qwen3-moe", "Qwen3MoeForCausalLM"),
}
# a 16-bit row per layer, by hand: K and V x kv heads x head dim x 2 bytes (MLA: one latent row of
# kv_lora_rank + rope dims); int8 / fp8 add a 2-byte scale per row
HAND_F16 = {
    "llama-gqa": 2 * (2 * 2 * 16 * 2),
    "mistral-window": 2 * (2 * 2 * 16 * 2),
    "gemma3": 3 * (2 * 2 * 16 * 2),
    "deepseek-v3": 2 * (32 + 8) * 2,
    "qwen3-moe": 2 * (2 * 2 * 16 * 2),
}
HAND_INT8 = {"llama-gqa": 2 * 2 * 2 * (16 + 2), "deepseek-v3": 2 * (32 + 8 + 2)}
TORCH_KV = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def model_config(name):
    tiny, arch = CONFIGS[name]
    cls, extra = TINY_MODELS[tiny]
    return config_from_hf_dict({**cls(**{**TINY_BASE, **extra}).to_dict(), "architectures": [arch]})


def engine_specs(config):
    net = build_model(config, UnquantizedConfig(), torch.float32, torch.device("meta"))
    return {m.layer_name: m for m in net.modules() if isinstance(m, Attention)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_bytes_per_token_match_the_hand_count_and_the_engine_specs(name):
    config = model_config(name)
    facts = facts_from_config(config, name)
    assert facts.kv_bytes_per_token("float16") == HAND_F16[name]
    if name in HAND_INT8:
        assert facts.kv_bytes_per_token("int8") == HAND_INT8[name]
    layers = engine_specs(config)
    for dtype, torch_dtype in TORCH_KV.items():
        assert facts.kv_bytes_per_token(dtype) == sum(m.kv_spec(torch_dtype).bytes_per_token for m in layers.values())


def test_window_layers_hold_at_most_their_window():
    mistral = facts_from_config(model_config("mistral-window"), "m")
    assert mistral.kv_bytes_per_sequence(10, "float16") == 10 * HAND_F16["mistral-window"]
    assert mistral.kv_bytes_per_sequence(1000, "float16") == 24 * HAND_F16["mistral-window"]
    gemma = facts_from_config(model_config("gemma3"), "g")
    row = 2 * 2 * 16 * 2
    assert [layer.window for layer in gemma.layers] == [8, None, 8]
    assert gemma.kv_bytes_per_sequence(100, "float16") == row * 100 + 2 * row * 8


def test_moe_total_and_active_parameters_and_experts_touched():
    facts = facts_from_config(model_config("qwen3-moe"), "moe")
    per_layer_experts = 8 * 3 * 64 * 32
    assert facts.experts == 2 * per_layer_experts and (facts.num_experts, facts.experts_per_token) == (8, 3)
    assert facts.active_params == facts.total_params - 2 * (8 - 3) * 3 * 64 * 32
    assert facts.expert_fraction(1) == 3 / 8 and facts.expert_fraction(2) == pytest.approx(1 - (5 / 8) ** 2)
    _, read, experts = facts.weight_bytes("float16")
    hw = Hardware("t", "gpu", 1e12, 1e9, {"float16": 1e15})
    step = rl.decode_step(facts, hw, "float16", "float16", 1, 100)
    assert step.bytes == read + experts * 3 / 8 + 100 * facts.kv_bytes_per_token("float16")


def test_llama_weight_bytes_and_roofline_by_hand():
    facts = facts_from_config(model_config("llama-gqa"), "llama")
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q, o; k, v; gate, up, down
    assert (facts.linear, facts.head, facts.embedding, facts.other) == (linear, 256 * 64, 256 * 64, 2 * 2 * 64 + 64)
    held, read, _ = facts.weight_bytes("float32")
    assert held == 4 * (linear + 2 * 256 * 64 + 320) and read == 4 * (linear + 256 * 64 + 320)
    _, read4, _ = facts.weight_bytes("int4")
    assert read4 == linear * 5 / 8 + 256 * 64 * 8.5 / 8 + 320 * 2
    hw = Hardware("t", "cpu", 1e9, 1e9, {"float32": 2e9})
    context = 64
    kv = context * HAND_F16["llama-gqa"]
    flops_per_token = 2 * (linear + 256 * 64) + 2 * 2 * 4 * (16 + 16) * context  # weights; q.k and p.v, 2 layers
    for batch in (1, 8, 256):
        step = rl.decode_step(facts, hw, "float32", "float16", batch, context)
        seconds = max((read + batch * kv) / 1e9, batch * flops_per_token / 2e9)
        assert step.tokens_per_s == pytest.approx(batch / seconds)
    cross = rl.crossover_batch(facts, hw, "float32", "float16", context)
    compute_bound = lambda b: b * flops_per_token / 2e9 >= (read + b * kv) / 1e9  # noqa: E731
    assert compute_bound(cross) and not compute_bound(cross - 1)
    pre = rl.prefill(facts, hw, "float32", 512)
    assert pre.flops == 512 * (2 * (linear + 256 * 64) + 2 * 2 * 4 * 32 * 512 / 2) and pre.bound == "compute"
    assert rl.expected_tokens_per_verify(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    verify = rl.decode_step(facts, hw, "float32", "float16", 1, context, query_tokens=5)
    plain = rl.decode_step(facts, hw, "float32", "float16", 1, context)
    assert rl.speculative_speedup(facts, hw, "float32", "float16", context, 0.8, 4) == pytest.approx(
        (1 - 0.8**5) / 0.2 * plain.seconds / verify.seconds
    )
    # fit: the weights, then whole sequences of KV
    memory = held + 3.5 * kv
    assert rl.sequences_that_fit(facts, "float32", "float16", context, memory) == 3
    assert rl.max_context_that_fits(facts, "float32", "float16", held + 100 * HAND_F16["llama-gqa"]) == 100


def plan_json(capsys, *args):
    main(["plan", "--json", *args])
    return json.loads(capsys.readouterr().out)


def test_plan_on_the_default_model_with_named_and_cached_hardware(capsys, tmp_path, monkeypatch):
    p = plan_json(capsys, "--hardware", "h100", "--context", "2048", "--concurrency", "8")
    assert p["hardware"]["name"] == "h100" and p["weight_format"] == "file" and p["model"]["layers"] == 30
    assert next(k for k in p["kv"] if k["dtype"] == "float16")["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert [d["batch"] for d in p["decode"]][:4] == [1, 2, 4, 8] and p["recommendations"]
    main(["plan", "--hardware", "h100"])  # the human tables
    assert "Decode roofline" in capsys.readouterr().out
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(
        json.dumps(
            dict(name="fake", kind="cpu", memory_bytes=8e9, bandwidth=1e10, flops={"float32": 1e11}, source="test")
        )
    )
    p = plan_json(capsys, "--hardware", "auto", "--context", "512")
    first = p["decode"][0]
    assert p["hardware"]["name"] == "fake" and p["compute"] == "float32" and first["bound"] == "memory"
    assert first["tokens_per_s"] == pytest.approx(1e10 / first["bytes"])
    assert p["weights"][0]["format"] == "gguf Q4_1"


def test_max_model_len_auto_is_what_the_engine_pool_holds():
    llama = {n: m.kv_spec(torch.float16) for n, m in engine_specs(model_config("llama-gqa")).items()}
    per_block = 16 * HAND_F16["llama-gqa"]
    cache = CacheConfig(kv_cache_memory_gib=100 * per_block / 2**30)
    assert max_model_len_that_fits(llama, cache, 4096) == 100 * 16
    assert max_model_len_that_fits(llama, cache, 1000) == 1000
    mistral = {n: m.kv_spec(torch.float16) for n, m in engine_specs(model_config("mistral-window")).items()}
    assert max_model_len_that_fits(mistral, cache, 4096) == 4096  # every layer windowed
    with pytest.raises(ValueError, match="smaller than one KV block"):
        max_model_len_that_fits(llama, CacheConfig(kv_cache_memory_gib=per_block / 2 / 2**30), 4096)


def test_the_int8_peak_counts_every_threads_multiply_adds():
    if block_quant.load() is None:
        pytest.skip("no compiled kernels")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = block_quant.int8_peak(1000)
        assert one > 0 and block_quant.int8_peak(3000) == 3 * one
        torch.set_num_threads(2)
        assert block_quant.int8_peak(1000) == 2 * one
    finally:
        torch.set_num_threads(previous)


def test_a_record_measured_the_old_way_is_measured_again(tmp_path, monkeypatch):
    """A cached record of this machine from before bandwidth on huge pages and the int8 peak (its rates
    one kernel's) is replaced; a record written by hand (another name) is kept as it is."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_path().parent.mkdir(parents=True)
    old = dict(name="this machine", kind="cpu", memory_bytes=8e9, bandwidth=1.0, flops={"int8": 1.0}, source="old")
    cache_path().write_text(json.dumps(old))
    fresh = this_machine()
    assert MEASURED_BY in fresh.source and fresh.bandwidth > 1e6
    assert fresh.flops["float32"] > 1e6 and fresh.flops.get("int8", 2.0) > 1.0
    assert json.loads(cache_path().read_text())["source"] == fresh.source  # cached for the next call
    cache_path().write_text(json.dumps({**old, "name": "my box"}))
    assert this_machine().bandwidth == 1.0
