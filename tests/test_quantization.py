"""Weight-only int8 quantization: close to the float32 model, and the engine runs with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import make_core, make_tiny_model, run_core
from tokenmill.loader import load_model
from tokenmill.models.quantization import Int8Linear, quantize_model
from tokenmill.sampling_params import SamplingParams


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = nn.Linear(256, 384, bias=True)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight.shape == (384, 256)
    x = torch.randn(7, 256)
    ref, out = linear(x), q(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 0.02


def test_quantized_model_tracks_the_float_model(tmp_path):
    make_tiny_model("qwen2-bias", tmp_path)
    ref = load_model(str(tmp_path))
    quant = load_model(str(tmp_path), quantization="int8")
    assert not any(isinstance(m, nn.Linear) for m in quant.model.modules())
    prompts = [[(7 * i + j) % 256 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = run_core(make_core(str(tmp_path), loaded=ref), prompts, params)
    b = run_core(make_core(str(tmp_path), loaded=quant), prompts, params)
    agree = sum(x == y for k in a for x, y in zip(a[k], b[k])) / sum(len(v) for v in a.values())
    assert agree > 0.8  # near-ties may flip; the bulk of greedy tokens agree


def test_quantization_errors():
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="not available on cuda"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int8", torch.device("cuda"))
