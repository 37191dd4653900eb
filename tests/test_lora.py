"""LoRA adapters against PEFT on a tiny random model: greedy token-exact per adapter, a batch mixing
adapters and the base model equal to each alone, run-time load / unload, prefix-cache keys by
adapter, the delta on a quantized base layer, and bad adapters refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
from helpers import (
    assert_same_greedy,
    greedy_reference,
    make_lora_adapter,
    make_tiny_model,
    run_core,
    write_tiny_gguf,
)

from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig
from tokenmill.engine.core import EngineCore, RequestRejected
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.layers.forward_context import ForwardContext, set_forward_context
from tokenmill.loader import load_model
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.peft import LoRAError
from tokenmill.sampling_params import SamplingParams

PROMPTS = {None: [5, 9, 200, 31, 7, 88, 14], "a": [3, 3, 40, 41, 42, 100, 2, 9, 9], "b": [77, 1, 60]}
NEW_TOKENS = 8
GREEDY = dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The base model's directory, two adapters' directories and each one's greedy reference per prompt."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("llama-gqa-untied", root / "base")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    make_lora_adapter(base, root / "a", 1, r=8, lora_alpha=16, target_modules=every)
    make_lora_adapter(
        base, root / "b", 2, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    refs = {None: greedy_reference(base, PROMPTS[None], NEW_TOKENS)}
    for name in ("a", "b"):
        adapted = peft.PeftModel.from_pretrained(base, root / name).eval()
        refs[name] = greedy_reference(adapted, PROMPTS[name], NEW_TOKENS)
        adapted.unload()
    return root, refs


def lora_core(root, quantization: str = "auto", **modules) -> EngineCore:
    config = EngineConfig(
        model=str(root / "base"),
        quantization=quantization,
        cache=CacheConfig(num_blocks=64, block_size=4),
        lora=LoRAConfig({k: str(v) for k, v in modules.items()}, max_loras=2, max_lora_rank=8),
    )
    return EngineCore(config, UniProcExecutor(config), set())


def test_mixed_batch_matches_peft_and_each_alone(tiny):
    root, refs = tiny
    core = lora_core(root, a=root / "a", b=root / "b")
    names = [None, "a", "b", "a"]
    params = [SamplingParams(**GREEDY, lora_name=n) for n in names]
    # the last request: adapter a's prompt on the base model, which must continue it differently
    mixed = run_core(core, [PROMPTS[n] for n in names] + [PROMPTS["a"]], params + [SamplingParams(**GREEDY)])
    assert mixed["4"] != mixed["1"]
    for i, name in enumerate(names):
        assert_same_greedy(mixed[str(i)], *refs[name])
    for name in (None, "a", "b"):
        alone = run_core(core, [PROMPTS[name]], SamplingParams(**GREEDY, lora_name=name))
        assert alone["0"] == mixed[str(names.index(name))]
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_load_unload_at_run_time_and_prefix_keys(tiny):
    root, refs = tiny
    core = lora_core(root)
    with pytest.raises(RequestRejected) as e:
        core.add_request(EngineCoreRequest("x", PROMPTS["a"], SamplingParams(**GREEDY, lora_name="a")))
    assert e.value.param == "model"
    # the base model caches the prompt's blocks; the adapter must not reuse them (its K/V differ)
    run_core(core, [PROMPTS["a"]], SamplingParams(**GREEDY))
    core.load_lora("a", str(root / "a"))
    core.add_request(EngineCoreRequest("r", PROMPTS["a"], SamplingParams(**GREEDY, lora_name="a")))
    out, cached = [], None
    while core.has_unfinished():
        for o in core.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 0
    assert_same_greedy(out, *refs["a"])
    again = run_core(core, [PROMPTS["a"]], SamplingParams(**GREEDY, lora_name="a"))
    assert again["0"] == out  # its own blocks are hits for the same adapter
    assert core.scheduler.kv.prefix_hits > 0
    with pytest.raises(LoRAError) as e:
        core.load_lora("a", str(root / "b"))
    assert e.value.param == "lora_name"
    core.unload_lora("a")
    with pytest.raises(LoRAError):
        core.unload_lora("a")
    core.load_lora("b2", str(root / "b"))  # the freed slot, another adapter
    got = run_core(core, [PROMPTS["b"]], SamplingParams(**GREEDY, lora_name="b2"))
    assert_same_greedy(got["0"], *refs["b"])
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_bad_adapters_are_refused(tiny, tmp_path):
    root, _ = tiny
    core = lora_core(root)
    with pytest.raises(LoRAError, match="not a PEFT adapter"):
        core.load_lora("x", str(tmp_path))
    big = json.loads((root / "a" / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(big, r=32)))
    (tmp_path / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRAError, match="max-lora-rank"):
        core.load_lora("x", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(big, use_dora=True)))
    with pytest.raises(LoRAError, match="use_dora"):
        core.load_lora("x", str(tmp_path))
    assert core.loras == {}
    with pytest.raises(ValueError, match="--max-loras is 1"):
        LoRAConfig({"a": "1", "b": "2"}, max_loras=1)


def test_hostile_adapter_files_are_refused_naming_the_path(tiny, tmp_path):
    """What a client can put at lora_path: each a LoRAError (the server's 400 naming lora_path), none an
    error of another kind (a 500), and the engine serves on."""
    from safetensors.torch import load_file, save_file

    root, _ = tiny
    core = lora_core(root)
    config = json.loads((root / "a" / "adapter_config.json").read_text())
    weights = (root / "a" / "adapter_model.safetensors").read_bytes()

    def adapter(config_text: str, weight_bytes: bytes = weights) -> str:
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "adapter_config.json").write_text(config_text)
        (d / "adapter_model.safetensors").write_bytes(weight_bytes)
        return str(d)

    nan = load_file(str(root / "a" / "adapter_model.safetensors"))
    first = sorted(nan)[0]
    nan[first] = nan[first].clone().fill_(float("nan"))
    save_file(nan, str(tmp_path / "nan.safetensors"))
    cases = [
        (str(tmp_path / ("x" * 300)), "cannot read"),  # a name too long for the file system
        (adapter("[1, 2]"), "JSON object"),
        (adapter("null"), "JSON object"),
        (adapter(json.dumps(dict(config, lora_alpha="16"))), "lora_alpha"),
        (adapter(json.dumps(dict(config, lora_alpha=None))), "lora_alpha"),
        (adapter('{"r": 8, "lora_alpha": NaN}'), "lora_alpha"),
        (adapter(json.dumps(config), b"not safetensors at all"), "cannot read"),
        (adapter(json.dumps(config), (tmp_path / "nan.safetensors").read_bytes()), "NaN"),
        (adapter(" " * (2 << 20)), "over"),
    ]
    for path, words in cases:
        with pytest.raises(LoRAError, match=words) as e:
            core.load_lora("x", path)
        assert e.value.param == "lora_path", (path, e.value)
    assert core.loras == {}
    core.load_lora("x", str(root / "a"))  # and a good one still loads
    assert "x" in core.loras


def test_delta_on_a_quantized_base_layer(tiny):
    """The adapter's delta is added to what the int8 weight format computes: exactly PEFT's term."""
    root, _ = tiny
    loaded = load_model(str(root / "base"), quantization="int8")
    manager = LoRAManager(loaded.model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.float32, loaded.device)
    manager.load("a", str(root / "a"))
    layer = loaded.model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.input_size)
    plain = layer(x)
    batch = manager.batch([None, "a"], np.array([2, 3]))
    with set_forward_context(ForwardContext({}, batch)), torch.no_grad():
        adapted = layer(x)
    from safetensors.torch import load_file

    factors = load_file(str(root / "a" / "adapter_model.safetensors"))
    stem = "base_model.model.model.layers.0.mlp.down_proj"
    a, b = factors[f"{stem}.lora_A.weight"], factors[f"{stem}.lora_B.weight"]
    torch.testing.assert_close(adapted[:2], plain[:2], rtol=0, atol=0)
    torch.testing.assert_close(adapted[2:], plain[2:] + (x[2:] @ a.T) @ b.T * 2.0, rtol=0, atol=1e-5)


def test_compiled_decode_step_runs_the_adapters(tiny, monkeypatch):
    """A decode step with adapter tokens runs as the one C++ loop, adding the deltas with the LoRA kernel
    the layers call: the same tokens as the module-by-module forward, for a batch mixing adapters."""
    from tokenmill.kernels import decode_step

    if decode_step.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    root, _ = tiny
    names = [None, "a", "b", "a"]
    prompts, params = [PROMPTS[n] for n in names], [SamplingParams(**GREEDY, lora_name=n) for n in names]
    compiled = lora_core(root, a=root / "a", b=root / "b")
    fast = run_core(compiled, prompts, params)
    assert compiled.executor.runner.model.model.compiled_decode[1].lora  # the step ran compiled, with LoRA
    monkeypatch.setattr(decode_step.CompiledDecode, "build", classmethod(lambda cls, parts: None))
    assert run_core(lora_core(root, a=root / "a", b=root / "b"), prompts, params) == fast


def test_adapters_beside_moe_layers_leave_the_step_to_the_layers(tmp_path):
    """A MoE model whose adapter reaches its shared expert's projections: the compiled step (which runs
    no adapter in a MoE layer) is not built, and the layers serve the adapter and the base model."""
    base = make_tiny_model("qwen2-moe", tmp_path / "base")
    # the shared expert's and the dense layer's MLP by their paths: a bare "down_proj" also names the routed
    # experts' stacked parameter, which PEFT 0.22 adapts with a rank pattern (not plain LoRA)
    mlp = [f"{m}.{p}" for m in ("mlp", "shared_expert") for p in ("gate_proj", "up_proj", "down_proj")]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", *mlp]
    make_lora_adapter(base, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=targets)
    core = lora_core(tmp_path, a=tmp_path / "a")
    got = run_core(
        core, [PROMPTS["a"], PROMPTS["a"]], [SamplingParams(**GREEDY, lora_name="a"), SamplingParams(**GREEDY)]
    )
    assert core.executor.runner.model.model.compiled_decode[1] is None
    assert got["0"] != got["1"]  # the adapter changed its request's tokens
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_adapter_on_gguf_blocks_matches_peft_on_the_dequantized_weights(tiny, tmp_path):
    """Quantized base weights (GGUF blocks, exact mode): greedy tokens of PEFT's adapter over
    transformers' model holding the same dequantized weights, in a batch with a base-model request."""
    import transformers

    root, _ = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    qtypes = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_0", "ffn_up": "Q5_1", "ffn_down": "Q8_0"}
    write_tiny_gguf(hf, tmp_path / "m.gguf", qtypes)
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(dense, root / "a")
    ref = greedy_reference(adapted.eval(), PROMPTS["a"], NEW_TOKENS)
    config = EngineConfig(
        model=str(tmp_path / "m.gguf"),
        quantization="gguf",
        cache=CacheConfig(num_blocks=64, block_size=4),
        lora=LoRAConfig({"a": str(root / "a")}, max_loras=1, max_lora_rank=8),
    )
    core = EngineCore(config, UniProcExecutor(config), set())
    got = run_core(
        core, [PROMPTS["a"], PROMPTS[None]], [SamplingParams(**GREEDY, lora_name="a"), SamplingParams(**GREEDY)]
    )
    assert_same_greedy(got["0"], *ref)
    assert core.kv.num_free_blocks == core.kv.num_blocks
