"""Model loading and the forward pass, checked against HF transformers in float32."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from helpers import (
    TINY_MODELS,
    all_logits,
    assert_greedy_of,
    make_core,
    make_runner,
    make_tiny_model,
    run_core,
    write_tiny_gguf,
)

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

PROMPT_LENGTHS = [1, 2, 7, 16, 17, 64, 150, 300]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, directory)
    return request.param, str(directory), hf


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_prefill_logits_match_transformers(tiny):
    name, directory, hf = tiny
    runner = make_runner(load_model(directory, dtype="float32"))
    for ids in prompts(hf.config.vocab_size):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        ours = all_logits(runner, ids)
        scale = max(1.0, ref.abs().max().item())
        assert (ours - ref).abs().max().item() <= 1e-4 * scale, f"{name}: prompt of {len(ids)} tokens"


def test_greedy_matches_transformers_in_one_flat_batch(tiny):
    """All prompts run together through the engine (one flat batch per step) and each greedy
    continuation equals transformers' own greedy generate."""
    name, directory, hf = tiny
    batch = prompts(hf.config.vocab_size, seed=1)
    ours = run_core(make_core(directory), batch, GREEDY)
    for i, ids in enumerate(batch):
        assert_greedy_of(hf, ids, ours[str(i)], 32)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "deepseek-v3"])
def test_torch_fallback_matches_transformers(tmp_path, monkeypatch, name):
    """Where the C++ kernels cannot be built (no compiler), plain torch ops give the same results
    (a latent MLA cache included)."""
    from tokenmill.kernels import block_quant, decode_step, fused_ops, paged_attention

    for module in (block_quant, decode_step, fused_ops, paged_attention):
        monkeypatch.setattr(module, "load", lambda: None)
    hf = make_tiny_model(name, tmp_path)
    runner = make_runner(load_model(str(tmp_path)))
    assert runner.backend.name == "torch-sdpa"
    batch = prompts(hf.config.vocab_size)
    for ids in batch:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (all_logits(runner, ids) - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    ours = run_core(make_core(str(tmp_path)), batch, GREEDY)
    for i, ids in enumerate(batch):
        assert_greedy_of(hf, ids, ours[str(i)], 32)


def mixed_step_hidden(runner, batch: list[list[int]], cached: list[int], before=lambda: None) -> torch.Tensor:
    """Sequence i's first cached[i] tokens prefilled on its own, then (after calling `before`) one step of
    every sequence's other tokens together (those with one left first: the step's decodes, then the
    prompt chunks): the step's final hidden states."""
    bs, pools = runner.kv_cache_config.block_size, len(runner.kv_cache_config.pool_blocks)
    tables, start = [], 0
    for ids in batch:
        n = -(-len(ids) // bs)
        tables.append([list(range(start, start + n))] * pools)
        start += n
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]) - cached[i] > 1)
    with torch.inference_mode():
        for i in order:
            if cached[i]:
                runner.forward(np.array(batch[i][: cached[i]]), np.array([cached[i]]), np.array([0]), [tables[i]])
        before()
        hidden, _ = runner.forward(
            np.array([t for i in order for t in batch[i][cached[i] :]]),
            np.array([len(batch[i]) - cached[i] for i in order]),
            np.array([cached[i] for i in order]),
            [tables[i] for i in order],
        )
    return hidden


def decode_step_hidden(runner, batch: list[list[int]]) -> torch.Tensor:
    """Each prompt but its last token prefilled on its own, then one decode step of every last token
    together: that step's final hidden states."""
    return mixed_step_hidden(runner, batch, [len(ids) - 1 for ids in batch])


@pytest.mark.parametrize(
    "name,quantization,cache_dtype",
    [
        ("llama-gqa-untied", "none", "auto"),
        ("qwen2-bias", "none", "bfloat16"),
        ("llama-mqa-tied", "gguf", "auto"),
        ("qwen2-bias", "gguf-q8", "float16"),
        ("llama-gqa-untied", "int4", "auto"),
        ("llama-gqa-untied", "gguf-q8", "int8"),
        ("qwen2-bias", "none", "fp8_e4m3"),
        ("llama-mqa-tied", "gguf", "fp8_e5m2"),
        ("gemma3", "none", "auto"),  # q/k norms, sandwich norms, GELU-tanh, sliding and global groups
        ("gemma3", "int8", "float16"),
        ("gemma3", "int8-q8", "auto"),  # int8 activations on panels: the one parallel region
        ("gemma2", "none", "auto"),  # soft-capped attention scores
        ("gemma2", "int8-q8", "float16"),
        ("qwen3", "none", "bfloat16"),  # q/k norms
        ("qwen3", "int8-q8", "int8"),
        ("mistral-window", "none", "auto"),  # one sliding window
        ("mistral-window", "int8-q8", "auto"),
        ("phi3-window-partial", "none", "auto"),  # partial rotary: half of each head rotated
        ("phi3-window-partial", "int8-q8", "float16"),
        ("mixtral", "none", "auto"),  # routed experts (dense), renormalised
        ("qwen2-moe", "none", "auto"),  # and a gated shared expert, a dense layer
        ("qwen2-moe", "none", "int8"),
        ("mixtral", "gguf", "float16"),  # experts in GGUF blocks
        ("qwen3-moe", "gguf-q8", "auto"),  # on int8 panels
        ("gpt-oss", "none", "auto"),  # attention sinks, biased experts with the clamped SwiGLU
        ("gpt-oss", "mxfp4-checkpoint", "float16"),  # its released form: MXFP4 experts, int8 activations
    ],
)
def test_compiled_decode_step_is_bit_identical_to_the_layers(tmp_path, monkeypatch, name, quantization, cache_dtype):
    """A decode-only step runs as one C++ loop (`kernels.decode_step`) that must give exactly the
    module-by-module forward's hidden states (dense, GGUF blocks exact and int8, int4 and int8 quantized on
    load, the latter with int8 activations too ("int8-q8"); float32, 16-bit, int8 and fp8 KV caches)."""
    from tokenmill.kernels import decode_step

    if decode_step.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    hf = make_tiny_model(name, tmp_path)
    path = str(tmp_path)
    if quantization.startswith("gguf"):
        write_tiny_gguf(
            hf,
            tmp_path / "m.gguf",
            {
                "attn_q": "Q4_1",
                "attn_k": "Q4_1",
                "attn_v": "Q4_0",
                "attn_output": "Q8_0",
                "ffn_gate": "Q5_0",
                "ffn_up": "Q5_1",
                "ffn_down": "Q4_0",
                "output": "Q8_0",
                "token_embd": "Q8_0",
                "ffn_gate_exps": "Q4_1",
                "ffn_up_exps": "Q5_0",
                "ffn_down_exps": "Q8_0",
                "ffn_gate_shexp": "Q4_0",
                "ffn_up_shexp": "Q4_0",
            },
        )
        path = str(tmp_path / "m.gguf")
    if quantization == "mxfp4-checkpoint":  # the default dtype: the experts' int8 activations
        from test_fp8_fp4 import write_gpt_oss_mxfp4

        write_gpt_oss_mxfp4(hf, tmp_path / "mx")
        path = str(tmp_path / "mx")
    # int8-q8: int8 quantized on load, the default dtype: int8 activations, on panels
    load = dict(quantization="int8") if quantization == "int8-q8" else dict(quantization=quantization, dtype="float32")
    if quantization == "mxfp4-checkpoint":
        load = {}
    one_region = quantization in ("gguf-q8", "int8-q8")
    rng = random.Random(5)
    batch = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (1, 3, 17, 40, 90)]
    compiled = make_runner(load_model(path, **load), cache_dtype=cache_dtype)
    fast = decode_step_hidden(compiled, batch)
    assert compiled.model.model.compiled_decode[1] is not None  # the step ran compiled
    counted = [m.expert_tokens.clone() for m in compiled.moe_layers]  # the routing statistics (/metrics)
    # gguf-q8's step runs in one OpenMP region that splits products and attention over the threads, a
    # thread taking over what a late one has not started (the tests' process runs one): at two, and at
    # three on this 2-core host (threads preempted mid-step, their shares taken by the others), the same bits
    assert compiled.model.model.compiled_decode[1].step.runs_chunks == one_region
    threads = torch.get_num_threads()
    if one_region:
        try:
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(fast, decode_step_hidden(compiled, batch))
        finally:
            torch.set_num_threads(threads)
        assert compiled.model.model.compiled_decode[1] is not None
    monkeypatch.setattr(decode_step.CompiledDecode, "build", classmethod(lambda cls, parts: None))
    layers = make_runner(load_model(path, **load), cache_dtype=cache_dtype)
    assert torch.equal(fast, decode_step_hidden(layers, batch))
    assert layers.model.model.compiled_decode[1] is None
    assert all(torch.equal(a, m.expert_tokens) for a, m in zip(counted, layers.moe_layers, strict=True))


@pytest.mark.parametrize(
    "name,cache_dtype",
    [
        ("qwen2-bias", "auto"),
        ("qwen2-bias", "float16"),
        ("qwen2-bias", "int8"),
        ("gemma3", "auto"),  # q/k norms, sandwich norms, GELU-tanh, sliding and global groups
        ("gemma2", "float16"),  # and soft-capped scores
        ("qwen3-moe", "auto"),  # routed experts
    ],
)
def test_compiled_step_runs_prompt_chunks_beside_the_decodes(tmp_path, monkeypatch, name, cache_dtype):
    """A mixed step (decodes, then prompt chunks: one after cached tokens, one a prompt's start, one of
    3 tokens) runs in the compiled step's one parallel region, the chunks' attention as the backend's
    prefill kernel computes it: the layer-by-layer forward's bits, at one, two and three threads. A
    quantized cache's first chunk (which attends its own K/V as computed) and a short chunk after cached
    tokens (per-token decodes) leave the step to the layers. Qwen2 and Qwen3-MoE (its experts in the
    file's blocks) from a GGUF file (gguf-q8), Gemma quantized to int8 on load (int8 activations)."""
    from tokenmill.kernels import decode_step

    if decode_step.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    hf = make_tiny_model(name, tmp_path)
    if name in ("qwen2-bias", "qwen3-moe"):
        types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q5_0"}
        experts = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q5_0", "ffn_down_exps": "Q4_1"}
        types |= {"ffn_up": "Q5_0", "ffn_down": "Q4_1", "token_embd": "Q8_0", **experts}
        write_tiny_gguf(hf, tmp_path / "m.gguf", types)
        load = dict(model=str(tmp_path / "m.gguf"), quantization="gguf-q8", dtype="float32")
    else:
        load = dict(model=str(tmp_path), quantization="int8")
    rng = random.Random(7)
    batch = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (40, 17, 90, 40, 3, 30)]
    layouts = {
        "after cached": [39, 16, 30, 21, 2, 29],  # decodes; chunks of 60 and 19 tokens after cached ones
        "first chunks": [39, 16, 30, 0, 0, 29],  # and two prompts' first chunks (40 and 3 tokens)
        "short chunk": [39, 16, 30, 30, 2, 29],  # a 10-token chunk after cached tokens
    }
    calls = []  # the compiled steps run (the real ones)
    run = decode_step.CompiledDecode.__call__
    monkeypatch.setattr(
        decode_step.CompiledDecode, "__call__", lambda self, *a, **k: calls.append(1) or run(self, *a, **k)
    )
    compiled = make_runner(load_model(**load), cache_dtype=cache_dtype)
    threads = torch.get_num_threads()
    fast = {}
    try:
        for layout, cached in layouts.items():
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                hidden = mixed_step_hidden(compiled, batch, cached, calls.clear)
                fast.setdefault(layout, hidden)
                assert torch.equal(hidden, fast[layout])
                compiled_step = layout == "after cached" or (layout == "first chunks" and cache_dtype != "int8")
                assert len(calls) == compiled_step, (layout, n)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(decode_step.CompiledDecode, "build", classmethod(lambda cls, parts: None))
    layers = make_runner(load_model(**load), cache_dtype=cache_dtype)
    for layout, cached in layouts.items():
        assert torch.equal(fast[layout], mixed_step_hidden(layers, batch, cached)), layout


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_compiled_decode_step_leaves_layers_it_lacks_to_the_model(tmp_path, name):
    """Latent attention, grouped and sigmoid routing (DeepSeek): the model's own forward."""
    make_tiny_model(name, tmp_path)
    runner = make_runner(load_model(str(tmp_path), dtype="float32"))
    decode_step_hidden(runner, [[1, 2, 3], [4, 5]])
    assert getattr(runner.model.model, "compiled_decode", (None, None))[1] is None


def test_config_fields_are_read(tiny):
    name, directory, hf = tiny
    c = load_model(directory).config
    assert c.num_key_value_heads == hf.config.num_key_value_heads
    assert c.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    if name.startswith("deepseek"):
        h = hf.config
        assert (c.head_dim, c.kv_lora_rank, c.q_lora_rank, c.v_head_dim) == (
            h.qk_head_dim,
            h.kv_lora_rank,
            h.q_lora_rank,
            h.v_head_dim,
        )
        assert c.routing.scale == h.routed_scaling_factor and c.routing.scoring == (
            "sigmoid" if "v3" in name else "softmax"
        )
        assert (c.rope_scaling or {}).get("rope_type", "default") == h.rope_parameters["rope_type"]
    else:
        assert (
            c.head_dim == getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
        )
        assert c.qkv_bias == (name.startswith("qwen2") or name == "gpt-oss")
        assert c.qk_norm == name.startswith(("qwen3", "gemma3"))
    if name == "gpt-oss":  # sinks on every layer, the window on the sliding ones
        layers = load_model(directory).model.model.layers
        assert [layer.self_attn.attn.sliding_window for layer in layers] == [
            c.sliding_window if t == "sliding_attention" else None for t in hf.config.layer_types
        ]
        for ours, theirs in zip(layers, hf.model.layers):
            assert torch.equal(ours.self_attn.attn.sinks, theirs.self_attn.sinks)
    if name.startswith("gemma"):
        assert list(c.layer_types) == hf.config.layer_types and c.sliding_window == hf.config.sliding_window
        windows = [layer.self_attn.attn.sliding_window for layer in load_model(directory).model.model.layers]
        assert windows == [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    assert c.num_experts == (getattr(hf.config, "num_experts", None) or getattr(hf.config, "num_local_experts", 0))
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(c.sparse_layers) == sparse if c.num_experts else not sparse


# --- the default model: SmolLM2-135M-Instruct GGUF (Q4_1) against transformers' own GGUF loader ---


def test_smollm2_gguf_matches_transformers(default_model, tokenizer, hf_default_model):
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4,",
        "Les fleurs du jardin sont",
        "Q: What is 7 times 8?\nA:",
        "The quick brown fox",
        "In machine learning, a transformer is",
    ]
    batch = [tokenizer.encode(t) for t in texts]
    runner = make_runner(default_model, num_blocks=16)
    for ids in batch[:3]:
        with torch.no_grad():
            ref = hf_default_model(torch.tensor([ids])).logits[0]
        ours = all_logits(runner, ids)
        assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    del runner
    ours = run_core(make_core("smollm2-135m-instruct", num_blocks=64, loaded=default_model), batch, GREEDY)
    for i, ids in enumerate(batch):
        assert_greedy_of(hf_default_model, ids, ours[str(i)], 32)


# --- clear errors ---


def test_unknown_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="neither a known alias"):
        load_model("/nonexistent/model")


def test_missing_weights_and_corrupt_files(tmp_path):
    make_tiny_model("llama-gqa-untied", tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(str(tmp_path))


def test_checkpoint_missing_a_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama-gqa-untied", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 tensors.*layers.1.mlp.gate_up_proj"):
        load_model(str(tmp_path))


def _write_gguf(path, tensor_type, raw: np.ndarray):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_vocab_size(16)
    w.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type(tmp_path):
    import gguf

    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((16, 256 // block * size), dtype=np.uint8)
    _write_gguf(tmp_path / "m.gguf", qtype, raw)
    with pytest.raises(ValueError, match="IQ2_XXS.*not supported"):
        load_model(str(tmp_path / "m.gguf"))


def test_gguf_header_reads_as_gguf_py_reads_it(tmp_path):
    """Our header parser (`loader/gguf_file.py`) against gguf-py's reader on one file: every metadata
    type (scalars, strings, arrays of numbers and of strings), value tensors and block tensors
    (their bytes a row of blocks per row), a non-default alignment; a truncated file is an error."""
    import gguf

    from tokenmill.loader.gguf_file import GGUFFile

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -3), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -5), w.add_float32("t.f32", 0.1)
    (
        w.add_uint64("t.u64", 2**63),
        w.add_int64("t.i64", -(2**40)),
        w.add_float64("t.f64", 0.1),
        w.add_bool("t.bool", True),
    )
    w.add_string("t.str", "héllo"), w.add_array("t.ints", [1, -2, 3]), w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü" * 40]), w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    q4 = rng.integers(0, 256, (6, 2 * 18), dtype=np.uint8)  # 6 rows of two Q4_0 blocks
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((2, 2, 4)).astype(np.float16))
    w.add_tensor("c", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours, theirs = GGUFFile(tmp_path / "m.gguf"), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["t.strs"] == ["a", "", "ü" * 40] and ours.fields["t.u64"] == 2**63
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        ("a", gguf.GGMLQuantizationType.F32, (3, 5)),
        ("b", gguf.GGMLQuantizationType.F16, (2, 2, 4)),
        ("c", gguf.GGMLQuantizationType.Q4_0, (6, 64)),
    ]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.data.dtype == ref.data.dtype and np.array_equal(mine.data, ref.data)
    assert np.array_equal(ours.tensors[2].data, q4)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: theirs.tensors[2].data_offset + 10])  # inside c
    with pytest.raises(ValueError, match="tensor c runs past the end"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(ValueError, match="cannot read GGUF file.*ends inside its header"):
        load_model(str(tmp_path / "head.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        load_model(str(bad))


def test_device_and_dtype_errors(tmp_path):
    make_tiny_model("llama-mha", tmp_path)
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(str(tmp_path), dtype="float64")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(str(tmp_path), device="cuda")


def quantize_round_trip(t: torch.Tensor, qtype: str) -> torch.Tensor:
    """`t` as a GGUF file of type `qtype` stores it (quantized, then dequantized)."""
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(dequantize(quantize(t.numpy(), kind), kind).copy()).reshape(t.shape)


@pytest.mark.parametrize(
    "name",
    ["qwen3", "qwen3-moe", "qwen2-moe", "mixtral", "phi3", "phi3-window-partial", "deepseek-v2-yarn", "deepseek-v3"],
)
def test_gguf_files_of_each_family_match_transformers(tmp_path, name):
    """Qwen3 (q/k norms), Qwen2/3-MoE (stacked experts, shared expert with its gate), Mixtral ("llama"
    with experts), Phi-3 (fused tensors, longrope factors as tensors, window, partial rotary) and
    DeepSeek ("deepseek2": latent attention with kv_b split into k_b / v_b, yarn, router bias, sigmoid
    gating for V3), written as llama.cpp writes them with Q8_0 experts and queries (DeepSeek: also the
    latent projection and v_b), load from the GGUF file and match transformers on the same weights
    (the reference holds the Q8_0 values)."""
    hf = make_tiny_model(name, tmp_path, **({"mlp_only_layers": []} if name == "qwen2-moe" else {}))
    qtypes = {
        "ffn_up_exps": "Q8_0",
        "ffn_down_exps": "Q8_0",
        "ffn_gate_exps": "Q8_0",
        "attn_q": "Q8_0",
        "attn_kv_a_mqa": "Q8_0",
        "attn_v_b": "Q8_0",
    }
    with torch.no_grad():
        for layer in hf.model.layers:
            if getattr(layer.self_attn, "q_proj", None) is not None:  # DeepSeek with low-rank queries: None
                layer.self_attn.q_proj.weight.copy_(quantize_round_trip(layer.self_attn.q_proj.weight, "Q8_0"))
            if hasattr(layer.self_attn, "kv_b_proj"):
                a = layer.self_attn
                a.kv_a_proj_with_mqa.weight.copy_(quantize_round_trip(a.kv_a_proj_with_mqa.weight, "Q8_0"))
                kv_b = a.kv_b_proj.weight.view(a.num_heads, -1, a.kv_lora_rank)
                kv_b[:, a.qk_nope_head_dim :] = quantize_round_trip(kv_b[:, a.qk_nope_head_dim :].contiguous(), "Q8_0")
            if hasattr(layer.mlp, "experts"):
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    p.copy_(quantize_round_trip(p, "Q8_0"))
    write_tiny_gguf(hf, tmp_path / "m.gguf", qtypes)
    loaded = load_model(str(tmp_path / "m.gguf"), dtype="float32")  # the exact mode
    assert loaded.config.architecture == type(hf).__name__
    runner = make_runner(loaded)
    batch = prompts(hf.config.vocab_size, seed=2)[:6]
    for ids in batch:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (all_logits(runner, ids) - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    ours = run_core(make_core(str(tmp_path / "m.gguf"), loaded=loaded), batch, GREEDY)
    for i, ids in enumerate(batch):
        assert_greedy_of(hf, ids, ours[str(i)], 32)


@pytest.mark.parametrize("name", ["qwen2-moe", "mixtral"])
def test_routing_statistics_count_every_token_through_every_moe_layer(tmp_path, name):
    hf = make_tiny_model(name, tmp_path)
    core = make_core(str(tmp_path), prefix_caching=False)
    assert core.stats().expert_tokens == {i: [0] * 4 for i in core.executor.model_config.sparse_layers}
    batch = prompts(hf.config.vocab_size, seed=3)[:5]
    out = run_core(core, batch, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    forwarded = sum(len(p) + len(out[str(i)]) - 1 for i, p in enumerate(batch))  # the last token is never fed
    load = core.stats().expert_tokens
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(load) == sparse
    assert all(sum(counts) == forwarded * hf.config.num_experts_per_tok for counts in load.values())


@pytest.mark.parametrize("name", ["mistral-window", "phi3-window-partial"])
def test_blocks_out_of_the_window_return_to_the_pool(tmp_path, name):
    """Every layer windowed: a long sequence holds about window + block + chunk tokens of KV, not all
    of it, and still decodes exactly as transformers; the pool is whole afterwards."""
    hf = make_tiny_model(name, tmp_path)
    window, block, chunk = hf.config.sliding_window, 16, 32
    core = make_core(str(tmp_path), num_blocks=64, max_num_batched_tokens=chunk)
    assert [m.sliding_window for m in core.kv.managers] == [window]
    peak = []
    prompt = prompts(hf.config.vocab_size, seed=4)[-1]  # 300 tokens, far past the window
    out = run_core(core, [prompt], GREEDY, on_step=lambda c: peak.append(sum(c.kv.num_live_blocks("0"))))
    assert max(peak) <= (window + chunk) // block + 2 < len(prompt) // block
    assert_greedy_of(hf, prompt, out["0"], 32)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def info_rows(capsys, directory) -> dict[str, str]:
    from tokenmill.entrypoints.cli import main

    main(["info", "--model", str(directory)])
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in capsys.readouterr().out.splitlines())


def test_info_shows_active_parameters_and_the_window_bound(tmp_path, capsys):
    hf = make_tiny_model("qwen3-moe", tmp_path / "moe")
    c = hf.config
    total = sum(p.numel() for p in hf.parameters())
    inactive = (
        (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size * c.num_hidden_layers
    )
    rows = info_rows(capsys, tmp_path / "moe")
    assert (
        rows["parameters"] == f"{total / 1e3:.1f}K"
        and rows["active parameters"] == f"{(total - inactive) / 1e3:.1f}K per token"
    )
    assert rows["experts"] == f"{c.num_experts}, {c.num_experts_per_tok} per token, in {c.num_hidden_layers} layers"
    make_tiny_model("mistral-window", tmp_path / "window")
    rows = info_rows(capsys, tmp_path / "window")
    per_token = int(rows["KV bytes per token"].split()[0])
    assert rows["sliding window"] == "24 tokens in 2 of 2 layers"
    assert rows["KV bytes per sequence"].startswith(f"at most ~{(24 + 32) * per_token} ")
    make_tiny_model("gemma3", tmp_path / "gemma")
    rows = info_rows(capsys, tmp_path / "gemma")
    per_token = int(rows["KV bytes per token"].split()[0])
    assert rows["sliding window"] == "8 tokens in 2 of 3 layers"
    assert (
        rows["KV bytes per sequence"] == f"{per_token // 3} per token (full-attention layers) + at most "
        f"~{(8 + 32) * per_token * 2 // 3} (window layers)"
    )


def test_hybrid_models_free_only_their_window_layers_blocks(tmp_path):
    """Gemma 3 (window layers between global ones): two pools; the window pool's blocks return as they
    leave the window, the global pool keeps the whole sequence; outputs still equal transformers'."""
    hf = make_tiny_model("gemma3", tmp_path)
    window, block, chunk = hf.config.sliding_window, 16, 32
    core = make_core(str(tmp_path), num_blocks=64, max_num_batched_tokens=chunk)
    assert [m.sliding_window for m in core.kv.managers] == [None, window]
    live = []
    prompt = prompts(hf.config.vocab_size, seed=5)[-1]  # 300 tokens
    out = run_core(core, [prompt], GREEDY, on_step=lambda c: live.append(c.kv.num_live_blocks("0")))
    assert max(full for full, _ in live) == -(-(len(prompt) + 31) // block)  # the last token is never fed
    assert max(windowed for _, windowed in live) <= (window + chunk) // block + 2
    assert_greedy_of(hf, prompt, out["0"], 32)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_hybrid_prefix_cache_hits_need_every_pool(tmp_path):
    """A repeated prompt on a hybrid model: hits only as far as both pools still hold its blocks (window
    blocks that left the window sit in the free queue with their keys), and the output is unchanged."""
    hf = make_tiny_model("gemma3", tmp_path)
    core = make_core(str(tmp_path), num_blocks=64)
    prompt = prompts(hf.config.vocab_size, seed=6)[-2]  # 150 tokens
    first = run_core(core, [prompt], GREEDY)["0"]
    core.add_request(EngineCoreRequest("again", prompt, GREEDY))
    again = []
    while core.has_unfinished():
        again.extend(t for o in core.step() for t in o.new_token_ids)
    assert again == first and core.kv.prefix_hits == (len(prompt) - 1) // 16 * 16
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_mla_caches_one_latent_row_per_token(tmp_path, capsys):
    """DeepSeek's KV cache holds the latent + rope key (kv_lora_rank + rope values) per token and layer,
    not every head's K and V: the bytes drop by heads * (nope + rope + v) / (kv_lora_rank + rope)."""
    hf = make_tiny_model("deepseek-v3", tmp_path)
    c = hf.config
    row = c.kv_lora_rank + c.qk_rope_head_dim
    core = make_core(str(tmp_path), num_blocks=32)
    runner = core.executor.runner
    caches = [layer.self_attn.attn.kv_cache for layer in runner.model.model.layers]
    assert all(tuple(t.shape) == (1, 32, 16, 1, row) for t in caches)
    assert runner.kv_cache_config.bytes_per_token == c.num_hidden_layers * row * 4
    expanded = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    rows = info_rows(capsys, tmp_path)
    assert rows["KV bytes per token"] == f"{c.num_hidden_layers * row * 4} (torch.float32)"
    assert rows["KV layout"].endswith(
        f"would be {c.num_hidden_layers * expanded * 4} bytes per token ({expanded / row:.1f}x)"
    )


@pytest.mark.parametrize("name", ["deepseek-v2-yarn", "deepseek-v3"])
def test_mla_chunked_prefill_and_prefix_hits_match_transformers(tmp_path, name):
    """Prompts prefilled in 32-token chunks over the latent cache (each chunk attends to the cached
    latents), then the same prompts again from cached prefix blocks: transformers' greedy tokens each
    time, and the pool whole at the end."""
    hf = make_tiny_model(name, tmp_path)
    core = make_core(str(tmp_path), num_blocks=96, max_num_batched_tokens=32)
    batch = prompts(hf.config.vocab_size, seed=7)[-3:]  # 64, 150, 300 tokens
    for _ in range(2):
        out = run_core(core, batch, GREEDY)
        for i, ids in enumerate(batch):
            assert_greedy_of(hf, ids, out[str(i)], 32)
    assert core.kv.prefix_hits > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
