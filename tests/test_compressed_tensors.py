"""compressed-tensors checkpoints (llm-compressor's layouts): fp8 (float-quantized), int4/int8
(pack-quantized, with and without zero points and act-order; int-quantized), NVFP4 and MXFP4
(nvfp4-/mxfp4-pack-quantized). Each tiny checkpoint is written here by a reference packer that
follows the compressed-tensors documentation (values packed into int32 words at bits i * bits,
stored plus 2^(bits-1); two e2m1 values per byte, the first in the low nibble; NVFP4's
weight / global scale; E8M0 exponents biased by 127) and checked against a dense transformers
model holding the same dequantized weights."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import assert_matches_dense, make_core, make_tiny_model, run_core
from safetensors.torch import save_file
from test_int_quant import _fake_quantize

from tokenmill.kernels import block_quant, fp8_matmul
from tokenmill.layers.linear import LinearBase
from tokenmill.loader import load_model
from tokenmill.quantization.fp8 import FP8LinearMethod
from tokenmill.quantization.packed_checkpoint import PackedCheckpointMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    block_quant.load() is None or fp8_matmul.load() is None, reason="the CPU kernels cannot be built here"
)
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
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# -- reference packers -----------------------------------------------------------------------------


def pack_int32(values: np.ndarray, bits: int) -> torch.Tensor:
    """Signed values [rows, n] -> int32 words [rows, n * bits / 32]: value i at bits i * bits of the
    row's bit string, each stored plus 2^(bits-1)."""
    u = (values + 2 ** (bits - 1)).astype(np.uint64)
    per = 32 // bits
    u = u.reshape(u.shape[0], -1, per) << (np.arange(per, dtype=np.uint64) * bits)
    return torch.from_numpy(u.sum(-1).astype(np.uint32).view(np.int32))


def pack_int_layer(w: torch.Tensor, fmt: str, bits: int, group: int | None, symmetric: bool, act_order: bool, rng):
    """A linear weight in compressed-tensors' integer layout (scales float16, as in a float16 model;
    codes and zero points signed: the unsigned ones of the GPTQ packer less 2^(bits-1))."""
    order = rng.permutation(w.shape[1]) if act_order else None
    q, zeros, scales, g_idx = _fake_quantize(w.numpy(), bits, group or w.shape[1], symmetric, order)
    dense = torch.from_numpy(((q - zeros[:, g_idx]) * scales[:, g_idx]).astype(np.float32))
    q, zeros = q - 2 ** (bits - 1), zeros - 2 ** (bits - 1)
    parts = {"weight_scale": torch.from_numpy(scales).to(torch.float16)}
    if fmt == "pack-quantized":
        parts["weight_packed"] = pack_int32(q, bits)
        parts["weight_shape"] = torch.tensor(list(w.shape))
        if not symmetric:  # packed along the output rows
            parts["weight_zero_point"] = pack_int32(zeros.T, bits).T.contiguous()
    else:
        parts["weight"] = torch.from_numpy(q.astype(np.int8))
        if not symmetric:
            parts["weight_zero_point"] = torch.from_numpy(zeros.astype(np.int8))
    if act_order:
        parts["weight_g_idx"] = torch.from_numpy(g_idx)
    return parts, dense


def pack_fp8_layer(w: torch.Tensor, strategy: str):
    if strategy == "block":
        rb, cb = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        padded = torch.zeros(rb * 128, cb * 128)
        padded[: w.shape[0], : w.shape[1]] = w
        scale = padded.view(rb, 128, cb, 128).abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    else:
        scale = w.abs().amax().reshape(1) / 448 if strategy == "tensor" else w.abs().amax(1, keepdim=True) / 448
        full = scale
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    parts = {"weight": q, "weight_scale": scale.float(), "input_scale": torch.tensor([0.02])}
    return parts, q.float() * full


def _nearest_e2m1(u: np.ndarray) -> np.ndarray:
    """Signed nibbles (bit 3 the sign, bits 0-2 the magnitude index) of the nearest e2m1 values."""
    index = np.abs(np.abs(u)[..., None] - E2M1).argmin(-1)
    return (index | np.where(u < 0, 8, 0)).astype(np.uint8)


def pack_fp4_layer(w: torch.Tensor, fmt: str):
    block = 16 if fmt == "nvfp4-pack-quantized" else 32
    out, cols = w.shape
    wb = w.reshape(out, cols // block, block)
    amax = wb.abs().amax(-1)
    parts = {}
    if block == 16:
        glob = (448 * 6 / w.abs().amax()).reshape(1).float()
        stored = (amax / 6 * glob).to(torch.float8_e4m3fn)
        scale = stored.float() / glob
        parts.update(weight_scale=stored, weight_global_scale=glob)
    else:
        exponent = torch.floor(torch.log2(amax)).to(torch.int32) - 2
        parts["weight_scale"] = (exponent + 127).to(torch.uint8)
        scale = torch.ldexp(torch.ones_like(amax), exponent)
    nibbles = _nearest_e2m1((wb / scale[..., None]).numpy()).reshape(out, cols)
    parts["weight_packed"] = torch.from_numpy(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
    values = E2M1[nibbles & 7] * np.where(nibbles & 8, -1.0, 1.0)
    dense = torch.from_numpy(values.astype(np.float32)).reshape(out, cols // block, block) * scale[..., None]
    return parts, dense.reshape(out, cols)


# -- checkpoints -----------------------------------------------------------------------------------


def _group(fmt: str, targets: list[str], **weights) -> dict:
    return {
        "targets": targets,
        "format": fmt,
        "weights": weights,
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"},
    }


VARIANTS = {  # config groups, in order; "dense" modules are ignored
    "w4a16-sym-group32": [
        ("pack-quantized", ["Linear"], dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True))
    ],
    "w4a16-asym-group64-actorder": [
        (
            "pack-quantized",
            ["Linear"],
            dict(num_bits=4, type="int", strategy="group", group_size=64, symmetric=False, actorder="group"),
        )
    ],
    "w8a16-channel-asym": [
        ("pack-quantized", ["Linear"], dict(num_bits=8, type="int", strategy="channel", symmetric=False))
    ],
    "w8a8-int-channel": [
        ("int-quantized", ["Linear"], dict(num_bits=8, type="int", strategy="channel", symmetric=True))
    ],
    "fp8-block": [
        ("float-quantized", ["Linear"], dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))
    ],
    "fp8-tensor": [("float-quantized", ["Linear"], dict(num_bits=8, type="float", strategy="tensor"))],
    "nvfp4": [
        ("nvfp4-pack-quantized", ["Linear"], dict(num_bits=4, type="float", strategy="tensor_group", group_size=16))
    ],
    "mixed": [  # attention in fp8 per channel, MLP in MXFP4, one MLP down projection kept dense
        ("float-quantized", ["re:.*self_attn.*"], dict(num_bits=8, type="float", strategy="channel")),
        ("mxfp4-pack-quantized", ["re:.*mlp.*"], dict(num_bits=4, type="float", strategy="group", group_size=32)),
    ],
}
IGNORE = {"mixed": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]}


def write_checkpoint(hf, directory: Path, variant: str) -> transformers.PreTrainedModel:
    """`hf` saved in `variant`'s compressed-tensors layout; returns a float copy holding the dequantized
    weights (the LM head and ignored modules stay dense)."""
    groups, ignore = VARIANTS[variant], IGNORE.get(variant, ["lm_head"])
    matches = lambda module, t: (
        re.match(t[3:], module) is not None
        if t.startswith("re:")  # noqa: E731
        else t == module or t == "Linear"
    )
    dense = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    tensors = {}
    for name, v in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        chosen = None
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS and not any(matches(module, t) for t in ignore):
            chosen = next((g for g in groups if any(matches(module, t) for t in g[1])), None)
        if chosen is not None:
            fmt, _, args = chosen
            if fmt == "float-quantized":
                parts, v = pack_fp8_layer(v, args["strategy"])
            elif fmt.endswith("fp4-pack-quantized"):
                parts, v = pack_fp4_layer(v, fmt)
            else:  # act-order: shards of one input share a column order (a seed per layer and input)
                parent, _, leaf_module = module.rpartition(".")
                order_rng = np.random.default_rng(zlib.crc32(f"{parent}.{INPUT_OF[leaf_module]}".encode()))
                parts, v = pack_int_layer(
                    v,
                    fmt,
                    args["num_bits"],
                    args.get("group_size"),
                    args["symmetric"],
                    args.get("actorder") == "group",
                    order_rng,
                )
            tensors.update({f"{module}.{k}": t.contiguous() for k, t in parts.items()})
        dense.state_dict()[name].copy_(v)
        if chosen is None and not (name == "lm_head.weight" and hf.config.tie_word_embeddings):
            tensors[name] = v.contiguous()
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": groups[0][0],
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": _group(f, t, **w) for i, (f, t, w) in enumerate(groups)},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return dense


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compressed_tensors_checkpoints_match_the_dequantized_model(tmp_path, variant):
    """Exact mode (`--dtype float32`): the logits of a dense transformers model holding the same
    dequantized weights; the default mode (int8 activations on the block kernels) stays close; each
    layer runs the method its config group names, ignored ones dense; the engine serves it."""
    hf = make_tiny_model("llama-gqa-untied", tmp_path / "dense", hidden_size=256, intermediate_size=320)
    dense = write_checkpoint(hf, tmp_path / "ct", variant)
    path = str(tmp_path / "ct")
    exact, fast = load_model(path, dtype="float32"), load_model(path)
    assert exact.quantization == fast.quantization == "compressed-tensors"
    methods = {m.prefix: m.quant_method for m in exact.model.modules() if isinstance(m, LinearBase)}
    assert isinstance(methods.pop("lm_head"), UnquantizedLinearMethod)
    for prefix, method in methods.items():
        fp8 = variant.startswith("fp8") or (variant == "mixed" and "self_attn" in prefix)
        expected = (
            UnquantizedLinearMethod
            if variant == "mixed" and prefix == "model.layers.1.mlp.down_proj"
            else FP8LinearMethod
            if fp8
            else PackedCheckpointMethod
        )
        assert type(method) is expected, (prefix, method)
    act_order = variant.endswith("actorder")
    assert act_order == any(getattr(m, "input_perm", None) is not None for m in exact.model.modules())
    assert_matches_dense(dense, exact, fast)
    out = run_core(
        make_core(path, loaded=fast), [[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert len(out["0"]) == 6


def test_info_names_the_checkpoint_format(tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    write_checkpoint(
        make_tiny_model("llama-gqa-untied", tmp_path / "dense", hidden_size=256, intermediate_size=320),
        tmp_path / "ct",
        "nvfp4",
    )
    main(["info", "--model", str(tmp_path / "ct")])
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["weights"].strip() == "compressed-tensors"


def test_compressed_tensors_errors(tmp_path):
    hf = make_tiny_model("llama-gqa-untied", tmp_path / "dense", hidden_size=256, intermediate_size=320)
    write_checkpoint(hf, tmp_path / "ct", "w4a16-sym-group32")
    path = tmp_path / "ct"
    with pytest.raises(ValueError, match="--quantization awq disagrees with the checkpoint's quantization_config"):
        load_model(str(path), quantization="awq")
    with pytest.raises(
        ValueError,
        match="compressed-tensors checkpoint with integer or FP4 weights runs the block "
        "kernels on CPU in float32 or on CUDA; got cpu in torch.bfloat16",
    ):
        load_model(str(path), dtype="bfloat16")
    original = json.loads((path / "config.json").read_text())

    def rewrite(change) -> None:
        config = json.loads(json.dumps(original))
        change(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))

    cases = [
        (
            lambda q: q["config_groups"]["group_0"].update(format="marlin-24"),
            "config_groups.group_0: format 'marlin-24' is not supported",
        ),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2),
            "config_groups.group_0: pack-quantized with 2-bit weights is not supported",
        ),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=48),
            "group size 48 does not split its 256 input columns",
        ),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse compressed-tensors"),
        (lambda q: q.update(config_groups={}), "needs config_groups"),
        (
            lambda q: (
                q.update(ignore=[])
                or q["config_groups"].update(
                    group_1={
                        "targets": ["re:.*k_proj"],
                        "weights": {"num_bits": 8, "type": "float"},
                        "format": "float-quantized",
                    }
                )
                or q["config_groups"]["group_0"].update(targets=["re:.*(q|v|o|gate|up|down)_proj"])
            ),
            "fall in different compressed-tensors config_groups",
        ),
    ]
    for change, message in cases:
        rewrite(change)
        with pytest.raises(ValueError, match=message):
            load_model(str(path))
