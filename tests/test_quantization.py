"""Quantized weights: GGUF blocks kept as they are (the same weights, checked against transformers
on the dequantized file), and opt-in int8 (close to the float32 model)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from helpers import (all_logits, assert_same_greedy, greedy_reference, make_core, make_runner, make_tiny_model,
                     run_core, write_tiny_gguf)
from tokenmill.config import EngineConfig
from tokenmill.kernels import block_quant
from tokenmill.layers.linear import LinearBase, ReplicatedLinear
from tokenmill.loader import load_model
from tokenmill.loader.gguf_loader import GGUFWeight
from tokenmill.quantization import resolve_quantization
from tokenmill.quantization.gguf import FUSED_MAX_TOKENS, BlockQuantLinearMethod, GGUFConfig
from tokenmill.quantization.int8 import Int8Config, Int8LinearMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.sampling_params import SamplingParams

# a mix of block types per tensor, as llama.cpp's mixed quantizations do; ffn_gate and ffn_up differ
# in bits, so the fused gate_up layer must stay dense
MIXED = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1", "output": "Q8_0", "token_embd": "Q8_0"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_quant_linear_computes_on_the_gguf_weights(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((96, 160)) * 0.1).astype(np.float32)  # 5 blocks a row: an odd count
    raw = quantize(weight, GGMLQuantizationType[qtype])
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
    layer = ReplicatedLinear(160, 96, bias=True, quant_config=GGUFConfig({"w.weight": qtype}), prefix="w")
    assert isinstance(layer.quant_method, BlockQuantLinearMethod)
    layer.weight_loader("weight", GGUFWeight("w", GGMLQuantizationType[qtype], raw))
    layer.weight_loader("bias", torch.randn(96))
    bits = layer.quant_method.bits
    # bit for bit what gguf's dequantize gives
    assert torch.equal(block_quant.dequantize(layer.codes, layer.scales, layer.offsets, bits), ref)
    for rows in (1, 3, 4, 5, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1, 40):  # the fused kernel, then dequantize + GEMM
        x = torch.randn(rows, 160)
        torch.testing.assert_close(layer(x), x @ ref.T + layer.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied", "qwen2-bias"])
def test_gguf_blocks_match_transformers(tmp_path, name):
    """A GGUF file with Q4_0/Q4_1/Q8_0 tensors runs on its own blocks by default, and matches
    transformers loading the same file (dequantized to float32): logits closely, greedy exactly."""
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(make_tiny_model(name, tmp_path), tmp_path / "m.gguf", MIXED)
    path = str(tmp_path / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    loaded = load_model(path)
    assert loaded.quantization == "gguf"
    kinds = {n.rsplit(".", 1)[-1]: type(m.quant_method) for n, m in loaded.model.named_modules()
             if n.endswith(("proj", "head"))}
    assert kinds == {"qkv_proj": BlockQuantLinearMethod, "o_proj": BlockQuantLinearMethod,
                     "gate_up_proj": UnquantizedLinearMethod, "down_proj": BlockQuantLinearMethod,
                     "lm_head": BlockQuantLinearMethod}
    rng = random.Random(0)
    batch = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 40, 90)]
    runner = make_runner(loaded)
    for ids in batch:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(all_logits(runner, ids), ref, rtol=0, atol=1e-4 * max(1.0, ref.abs().max().item()))
    ours = run_core(make_core(path, loaded=loaded), batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for i, ids in enumerate(batch):
        assert_same_greedy(ours[str(i)], *greedy_reference(hf, ids, 24))


def test_gguf_quantization_choices(tmp_path):
    write_tiny_gguf(make_tiny_model("llama-gqa-untied", tmp_path), tmp_path / "m.gguf", MIXED)
    path = str(tmp_path / "m.gguf")
    dense = load_model(path, quantization="none")
    assert dense.quantization == "none" and not any(
        isinstance(getattr(m, "quant_method", None), BlockQuantLinearMethod) for m in dense.model.modules())
    assert load_model(path, dtype="bfloat16").quantization == "none"  # auto: blocks only in float32
    assert load_model(str(tmp_path), quantization="auto").quantization == "none"  # an HF directory
    with pytest.raises(ValueError, match="quantization 'gguf' runs a GGUF file's own blocks"):
        load_model(str(tmp_path), quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf' runs a GGUF file's own blocks"):
        load_model(path, dtype="bfloat16", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8"):
        EngineConfig(quantization="q3")


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = nn.Linear(256, 384, bias=True)
    q = ReplicatedLinear(256, 384, bias=True, quant_config=Int8Config(torch.device("cpu")), prefix="q")
    q.weight_loader("weight", linear.weight.detach())
    q.weight_loader("bias", linear.bias.detach())
    q.quant_method.process_after_loading(q)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (384, 256) and not hasattr(q, "weight")
    x = torch.randn(7, 256)
    ref, out = linear(x), q(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("kwargs", [dict(quantization="int8"), dict(dtype="bfloat16")], ids=["int8", "bfloat16"])
def test_lower_precision_tracks_the_float_model(tmp_path, kwargs):
    """int8 weights, or bfloat16 compute (torch attention path, bf16 KV cache), through the engine."""
    make_tiny_model("qwen2-bias", tmp_path)
    ref = load_model(str(tmp_path))
    quant = load_model(str(tmp_path), **kwargs)
    if "quantization" in kwargs:
        linears = [m for m in quant.model.modules() if isinstance(m, LinearBase)]
        assert linears and all(isinstance(m.quant_method, Int8LinearMethod) for m in linears)
    else:
        assert quant.dtype == torch.bfloat16 and quant.model.lm_head.weight.dtype == torch.bfloat16
    prompts = [[(7 * i + j) % 256 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = run_core(make_core(str(tmp_path), loaded=ref), prompts, params)
    b = run_core(make_core(str(tmp_path), loaded=quant), prompts, params)
    agree = sum(x == y for k in a for x, y in zip(a[k], b[k])) / sum(len(v) for v in a.values())
    assert agree > 0.8  # near-ties may flip; the bulk of greedy tokens agree


def test_quantization_errors():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8"):
        resolve_quantization("int3", "hf", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="not available on cuda"):
        Int8Config(torch.device("cuda"))
