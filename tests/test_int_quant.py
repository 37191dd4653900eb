"""Integer weights: dense checkpoints quantized on load (int8, int4) and AWQ / GPTQ checkpoints, all
run on the block kernels. The AWQ and GPTQ checkpoints are written here by reference packers that
follow the formats' documentation (AutoAWQ's GEMM layout, AutoGPTQ's), and checked against a dense
model built from those same dequantized weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from helpers import assert_matches_dense, make_core, make_tiny_model, run_core, top1_agreement
from safetensors.torch import save_file

from tokenmill.config import EngineConfig
from tokenmill.kernels import block_quant
from tokenmill.layers.linear import LinearBase, ReplicatedLinear
from tokenmill.loader import load_model
from tokenmill.quantization.int_quant import IntQuantConfig, QuantizeOnLoadMethod, quantize
from tokenmill.quantization.packed_checkpoint import PackedCheckpointMethod
from tokenmill.sampling_params import SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_OF = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "down",
}  # layers that share one input


@pytest.mark.parametrize(
    "bits,group,symmetric",
    [(8, None, True), (8, None, False), (8, 32, True), (4, 32, False), (4, 64, False), (4, 128, True)],
)
def test_on_load_codes_are_the_stored_weights(bits, group, symmetric):
    """The block kernels compute on exactly code * scale + minimum, with float32 activations to float
    precision and with int8 activations within the activations' rounding; the quantization error itself
    is bounded by the bits."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 256) * 0.05, torch.randn(5, 256)
    codes = quantize(w, bits, group, symmetric)
    stored = codes.q.astype(np.float32) * np.repeat(codes.scales, codes.block, 1)
    if codes.offsets is not None:
        stored += np.repeat(codes.offsets, codes.block, 1)
    err = float(np.linalg.norm(stored - w.numpy()) / w.norm())
    assert err < (0.01 if bits == 8 else 0.13)
    for int8_activations in (False, True):
        layer = ReplicatedLinear(
            256, 96, quant_config=IntQuantConfig(bits, group, symmetric, int8_activations), prefix="w"
        )
        layer.weight_loader("weight", w)
        assert isinstance(layer.quant_method, QuantizeOnLoadMethod) and not hasattr(layer, "weight")
        weight = block_quant.dequantize(layer.quant_method.blocks(layer))
        assert torch.equal(weight, torch.from_numpy(stored))
        ref = x @ weight.t()
        rel = ((layer(x) - ref).norm() / ref.norm()).item()
        assert rel < (1e-6 if not int8_activations else 0.02)
    held = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.offsets) if t is not None)
    assert held * 8 / w.numel() <= bits + 1.0  # float16 scale (+ minimum) per 32 values


def test_group_size_must_divide_the_layer():
    with pytest.raises(ValueError, match="quantization_group_size 128 does not divide its 96 input columns"):
        ReplicatedLinear(96, 32, quant_config=IntQuantConfig(4, 128, False, True), prefix="w")
    with pytest.raises(ValueError, match="quantization_group_size must be 32, 64 or 128"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="apply to --quantization int8 / int4, not 'none'"):
        EngineConfig(quantization="none", quantization_group_size=32)


# (load_model arguments, least top-1 agreement, largest relative logit error) on a random tiny model,
# whose near-flat logits make top-1 fragile: real models (BENCHMARKS.md, perplexity) lose far less
ON_LOAD = {
    "int8": (dict(quantization="int8"), 0.9, 0.05),
    "int4": (dict(quantization="int4"), 0.5, 0.3),
    "int4-g128-sym": (dict(quantization="int4", group_size=128, symmetric=True), 0.5, 0.45),
    "int4-exact": (dict(quantization="int4", dtype="float32"), 0.5, 0.3),
}


@pytest.mark.parametrize("variant", list(ON_LOAD))
def test_on_load_quantization_tracks_the_float_model(tmp_path, variant):
    kwargs, least_agreement, largest_error = ON_LOAD[variant]
    make_tiny_model("qwen2-bias", tmp_path, hidden_size=128, intermediate_size=256)
    ref, quant = load_model(str(tmp_path)), load_model(str(tmp_path), **kwargs)
    assert quant.quantization == kwargs["quantization"]
    linears = [m for m in quant.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, QuantizeOnLoadMethod) for m in linears)
    assert quant.model.lm_head.quant_method.bits == 8  # the head keeps 8 bits under int4
    assert all(m.quant_method.int8_activations == (kwargs.get("dtype") is None) for m in linears)
    agree, error = top1_agreement(ref, quant)
    assert agree >= least_agreement and error < largest_error
    out = run_core(
        make_core(str(tmp_path), loaded=quant),
        [[1, 2, 3, 4]],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert len(out["0"]) == 6  # and it serves through the engine


# -- reference packers, from the formats' documentation ---------------------------------------------


def _fake_quantize(w: np.ndarray, bits: int, group: int, symmetric: bool, order: np.ndarray | None):
    """Integer codes q [out, in] with zeros and scales [out, groups] such that w ~ (q - z) * s, the
    groups taken over the input columns in `order` (act-order) or as runs."""
    out, cols = w.shape
    order = np.arange(cols) if order is None else order
    g_idx = np.empty(cols, dtype=np.int32)
    g_idx[order] = np.arange(cols) // group
    top = 2**bits - 1
    q = np.zeros((out, cols), dtype=np.int64)
    zeros = np.zeros((out, cols // group), dtype=np.int64)
    scales = np.zeros((out, cols // group), dtype=np.float32)
    for g in range(cols // group):
        members = np.flatnonzero(g_idx == g)
        block = w[:, members]
        if symmetric:
            s = (2 * np.abs(block).max(1) / top).astype(np.float16).astype(np.float32)
            z = np.full(out, 2 ** (bits - 1))
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = ((hi - lo) / top).astype(np.float16).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, top).astype(np.int64)
        q[:, members] = np.clip(np.rint(block / s[:, None]) + z[:, None], 0, top)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, g_idx


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis (a multiple of 32 / bits) into int32 words, value i at bits i * bits."""
    per = 32 // bits
    v = values.reshape(*values.shape[:-1], -1, per).astype(np.uint64)
    return (v << (np.arange(per, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32).view(np.int32)


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    order = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ's nibble order within a word

    def pack(a):  # [rows, out] -> [rows, out / 8], outputs 8j + order[i] in nibble i
        return _words(a.reshape(a.shape[0], -1, 8)[..., order].reshape(a.shape[0], -1), 4)

    return {
        "qweight": torch.from_numpy(pack(q.T)),
        "qzeros": torch.from_numpy(pack(zeros.T)),
        "scales": torch.from_numpy(scales.T.astype(np.float16)),
    }


def pack_gptq(q, zeros, scales, g_idx, bits, v2: bool) -> dict[str, torch.Tensor]:
    qweight = _words(q.T.reshape(-1, 32 // bits, q.shape[0]).transpose(0, 2, 1), bits)[..., 0]  # inputs along words
    stored_zeros = zeros.T - (0 if v2 else 1)  # the original format stores z - 1
    return {
        "qweight": torch.from_numpy(qweight),
        "qzeros": torch.from_numpy(_words(stored_zeros, bits)),
        "scales": torch.from_numpy(scales.T.astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx),
    }


def write_quantized_checkpoint(
    hf,
    directory,
    method: str,
    bits: int = 4,
    group: int = 32,
    symmetric: bool = False,
    act_order: bool = False,
    v2: bool = False,
) -> transformers.PreTrainedModel:
    """Save `hf`'s config and weights with every decoder linear in `method`'s layout to `directory`;
    return a float copy of `hf` holding the dequantized weights."""
    rng = np.random.default_rng(0)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    dense = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    tensors, orders = {}, {}
    for name in list(state):
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in LINEARS or parts[-1] != "weight":
            continue
        w = state.pop(name).numpy()
        key = (parts[2], INPUT_OF[parts[-2]])  # layer, input: shards of one input share the act order
        order = orders.setdefault(key, rng.permutation(w.shape[1])) if act_order else None
        q, zeros, scales, g_idx = _fake_quantize(w, bits, group, symmetric, order)
        base = name.removesuffix(".weight")
        packed = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, g_idx, bits, v2)
        tensors.update({f"{base}.{k}": v.contiguous() for k, v in packed.items()})
        members = g_idx  # every column's group
        state_w = (q - zeros[:, members]) * scales[:, members]
        dense.state_dict()[name].copy_(torch.from_numpy(state_w.astype(np.float32)))
    for k, v in state.items():
        dense.state_dict()[k].copy_(v)
        if not (k == "lm_head.weight" and hf.config.tie_word_embeddings):
            tensors[k] = v.contiguous()
    config = hf.config.to_dict()
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group,
            "zero_point": not symmetric,
            "version": "gemm",
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": symmetric,
            "desc_act": act_order,
            "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return dense


CHECKPOINTS = {
    "awq": dict(method="awq"),
    "awq-g64": dict(method="awq", group=64),
    "gptq-sym": dict(method="gptq", symmetric=True),
    "gptq-asym-act-order": dict(method="gptq", act_order=True),
    "gptq-8bit-v2": dict(method="gptq", bits=8, v2=True),
    "gptq-8bit-sym-act-order": dict(method="gptq", bits=8, symmetric=True, act_order=True),
}


@pytest.mark.parametrize("variant", list(CHECKPOINTS))
def test_awq_gptq_checkpoints_match_the_dequantized_model(tmp_path, variant):
    """Exact mode: the logits of a dense transformers model holding the same dequantized weights;
    the default (int8 activations) stays close; no layer went through a dense weight."""
    spec = CHECKPOINTS[variant]
    hf = make_tiny_model("llama-gqa-untied", tmp_path / "dense", hidden_size=128, intermediate_size=256)
    dense = write_quantized_checkpoint(hf, tmp_path / "q", **spec)
    path = str(tmp_path / "q")
    exact, fast = load_model(path, dtype="float32"), load_model(path)
    assert exact.quantization == fast.quantization == spec["method"]
    linears = [m for m in exact.model.modules() if isinstance(m, LinearBase) and m.prefix != "lm_head"]
    assert linears and all(isinstance(m.quant_method, PackedCheckpointMethod) for m in linears)
    assert all(m.input_perm is not None for m in linears) == spec.get("act_order", False)
    assert_matches_dense(dense, exact, fast)


def test_checkpoint_quantization_errors(tmp_path):
    hf = make_tiny_model("llama-gqa-untied", tmp_path / "dense", hidden_size=128, intermediate_size=256)
    write_quantized_checkpoint(hf, tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match="--quantization gptq disagrees with the checkpoint's quantization_config"):
        load_model(str(tmp_path / "awq"), quantization="gptq")
    with pytest.raises(ValueError, match="--quantization int4 disagrees"):
        load_model(str(tmp_path / "awq"), quantization="int4")
    with pytest.raises(ValueError, match="--quantization awq reads a checkpoint quantized with AWQ"):
        load_model(str(tmp_path / "dense"), quantization="awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes', which is not supported"):
        load_model(str(tmp_path / "awq"))
