"""Quantized weights: GGUF blocks kept as they are (the same weights, checked against transformers
on the dequantized file). On-load int8/int4 and AWQ/GPTQ checkpoints: tests/test_int_quant.py."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import (
    all_logits,
    assert_greedy_of,
    make_core,
    make_runner,
    make_tiny_model,
    run_core,
    write_tiny_gguf,
)

from tokenmill.config import EngineConfig
from tokenmill.kernels import block_quant, cpu_flags
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.loader import load_model
from tokenmill.loader.gguf_loader import GGUFWeight
from tokenmill.quantization import resolve_quantization
from tokenmill.quantization.gguf import BF16_MIN_TOKENS, FUSED_MAX_TOKENS, BlockQuantLinearMethod, GGUFConfig
from tokenmill.sampling_params import SamplingParams

# a mix of block types per tensor, as llama.cpp's mixed quantizations do; ffn_gate and ffn_up differ
# in bits, so the fused gate_up layer takes the wider (8-bit) layout
MIXED = {
    "attn_q": "Q4_1",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_1",
    "output": "Q8_0",
    "token_embd": "Q8_0",
}
PACKED = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# bytes per block, values per block, where its float16 scales sit (any other bytes are valid codes)
_FORMAT = {
    "Q4_0": (18, 32, [0]),
    "Q4_1": (20, 32, [0, 2]),
    "Q8_0": (34, 32, [0]),
    "Q5_0": (22, 32, [0]),
    "Q5_1": (24, 32, [0, 2]),
    "Q4_K": (144, 256, [0, 2]),
    "Q5_K": (176, 256, [0, 2]),
    "Q6_K": (210, 256, [208]),
}


def random_gguf_tensor(qtype: str, rows: int, cols: int, rng) -> tuple[object, torch.Tensor]:
    """A GGUF tensor of random blocks (random codes and sub-scales, small float16 scales), as the
    loader hands it over, and gguf's own dequantization of it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    size, values, scale_at = _FORMAT[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in scale_at:
        raw[..., at : at + 2] = rng.normal(0, 0.01, (rows, cols // values, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    kind = GGMLQuantizationType[qtype]
    return GGUFWeight("w", kind, raw), torch.from_numpy(dequantize(raw, kind).astype(np.float32).reshape(rows, cols))


@pytest.mark.parametrize("qtype", PACKED)
def test_block_quant_linear_computes_on_the_gguf_weights(qtype):
    rng = np.random.default_rng(0)
    cols = 768 if qtype.endswith("_K") else 160  # K-quants: 3 super-blocks a row; else 5 blocks: odd counts
    weight, ref = random_gguf_tensor(qtype, 96, cols, rng)
    layer = ReplicatedLinear(cols, 96, bias=True, quant_config=GGUFConfig({"w.weight": qtype}), prefix="w")
    assert isinstance(layer.quant_method, BlockQuantLinearMethod)
    layer.weight_loader("weight", weight)
    layer.weight_loader("bias", torch.randn(96))
    method = layer.quant_method
    assert method.bits == (4 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 8)  # exact mode: 5-, 6-bit codes as 8
    # bit for bit what gguf's dequantize gives
    assert torch.equal(block_quant.dequantize(method.blocks(layer)), ref)
    for rows in (1, 3, 4, 5, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1, 40):  # the fused kernel, then dequantize + GEMM
        x = torch.randn(rows, cols)
        want = x @ ref.T + layer.bias
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def q8_reference(x: torch.Tensor, ref: torch.Tensor, span: int = 32) -> torch.Tensor:
    """`block_quant.matmul_q8` written with torch ops: x rounded to int8 per `span` values (scale max|x| /
    127, round half to even), times the exact weights."""
    m = x.shape[0]
    blocks = x.view(m, -1, span)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))) * d).view(x.shape)
    return rounded @ ref.T


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("qtype", PACKED)
def test_int8_activation_kernel_matches_its_torch_reference(qtype, wide):
    """gguf-q8's integer dot products equal the same rounding written in torch, on every layout
    (4-, 5-, 6- and 8-bit codes, blocks of 32 and of 16), held in about the file's own bits, and so
    does its large-batch GEMM path; both stay within ~1% of the exact product."""
    rng = np.random.default_rng(2)
    # 15 groups of 32 (eight, then pairs and one alone) or 28 (eight at a time, then four); K-quants: 2 or 4 supers
    cols = (1024 if wide else 512) if qtype.endswith("_K") else (896 if wide else 480)
    weight, ref = random_gguf_tensor(qtype, 80, cols, rng)
    layer = ReplicatedLinear(cols, 80, quant_config=GGUFConfig({"w.weight": qtype}, int8_activations=True), prefix="w")
    layer.weight_loader("weight", weight)
    method = layer.quant_method
    assert method.bits == {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}.get(qtype, 4)  # packed, not widened
    assert method.bf16_gemm == ({"amx_bf16", "amx_tile"} <= cpu_flags())
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in (layer.codes, layer.high, layer.scales, layer.offsets, layer.supers)
        if t is not None
    )
    assert weight_bytes <= 80 * cols * (method.bits + 1.25) / 8  # about the file's own bits a weight
    if qtype.endswith("_K"):  # a K-quant's sub-block integers a byte each, its super-block's float16 pair
        assert layer.scales.dtype == torch.int8 and layer.supers.dtype == torch.float16
        assert weight_bytes <= 80 * cols * (method.bits + 0.625) / 8  # file: 4.5 (Q4_K) to 6.5625 (Q6_K) bits
    assert torch.equal(block_quant.dequantize(method.blocks(layer)), ref)
    span = method.blocks(layer).activation_span  # a K-quant's super-block shares one activation scale
    assert span == (256 if qtype.endswith("_K") else 32)
    # the integer kernel: one row, tiles of 8 rows and partial ones, blocks of 256 rows; then (for 6-8
    # bits, or on CPUs with a faster float GEMM) dequantize + GEMM on the same rounded activations
    for rows in (1, 3, 4, 7, 8, 17, 40, 300):
        x = torch.randn(rows, cols)
        out = block_quant.matmul_q8(x, method.blocks(layer))
        want = q8_reference(x, ref, span)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
    limit = method.fused_max_tokens
    for rows in (1, 40) if limit is None else (limit, limit + 1):
        x = torch.randn(rows, cols)
        out = layer(x)
        # past the limit on AMX CPUs: torch's bfloat16 GEMM on the weight and activations rounded to bfloat16
        big = limit is not None and rows > limit and method.bf16_gemm
        want = (x.bfloat16() @ ref.bfloat16().T).float() if big else q8_reference(x, ref, span)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
        exact = x @ ref.T
        assert ((out - exact).norm() / exact.norm()).item() < 0.02


PANELED = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]  # gguf-q8 repacks them at load


def panel_scales_as_float32(panels: block_quant.Panels) -> block_quant.Panels | None:
    """The same panels with float32 scales, or None where they hold integers (Q6_K's)."""
    if panels.scales.dtype == torch.uint8:
        return None
    return dataclasses.replace(panels, scales=panels.scales.float())


@pytest.mark.parametrize("qtype", PACKED)
def test_int8_activation_kernel_on_panels_repacked_at_load(qtype):
    """gguf-q8 repacks 4-, 5- and 8-bit weights in blocks of 32, and Q6_K's, once loaded into panels of eight
    interleaved rows; multi-row steps
    run on them (the same rounding as `q8_reference`, within the blocks' kernel's tolerance: N and M
    not multiples of the panel's 8 rows nor the tile's, more rows than one pass's block of 64), one-row
    steps too, and each row's result is the same bits whatever else shares its step (so a request's
    tokens do not depend on its batch) and whether the panels' scales are stored as float16 or float32;
    other layouts and the exact mode keep no panels."""
    rng = np.random.default_rng(3)
    # K-quants: 3 super-blocks (an odd count)
    rows, cols = 83, 768 if qtype.endswith("_K") else 480
    weight, ref = random_gguf_tensor(qtype, rows, cols, rng)
    for int8_activations in (True, False):
        config = GGUFConfig({"w.weight": qtype}, int8_activations=int8_activations)
        layer = ReplicatedLinear(cols, rows, quant_config=config, prefix="w")
        layer.weight_loader("weight", weight)
        layer.quant_method.process_after_loading(layer)
        if not (int8_activations and qtype in PANELED and block_quant.load() is not None):
            assert layer.panels is None
            continue
        code_bytes = {4: 128, 5: 160}.get(layer.quant_method.bits, 256)  # 5 bits: nibbles and a plane
        assert layer.panels.codes.shape == (11, cols // 32, code_bytes)
        if qtype == "Q6_K":  # the file's integer sub-block scales and float16 super-block scales, as bytes
            assert layer.panels.scales.shape == (11, cols // 256, block_quant.Q6_K_PANEL_BYTES)
            assert layer.panels.scales.dtype == torch.uint8
        else:
            # scales and offsets, or the scales alone where the codes' center is an integer the kernel
            # takes back (Q4_0, Q5_0) or they are signed (Q8_0): the same results, fewer bytes a step
            parts = 1 if qtype in ("Q4_0", "Q5_0", "Q8_0") else 2
            assert layer.panels.scales.shape == (11, cols // 32, parts, 8)
            # float16 scales where each is a float16 value (not the K types': products of two scales)
            assert layer.panels.scales.dtype == (torch.float32 if qtype.endswith("_K") else torch.float16)
        as_float32 = panel_scales_as_float32(layer.panels)
        blocks = layer.quant_method.blocks(layer)
        for m in (1, 2, 5, 8, 9, 70):  # within fused_max_tokens (8 bits: 128)
            x = torch.randn(m, cols)
            out = layer(x)
            assert torch.equal(out, block_quant.matmul_q8_panels(x, layer.panels))
            if as_float32 is not None:
                assert torch.equal(out, block_quant.matmul_q8_panels(x, as_float32))
            assert all(torch.equal(out[i : i + 1], layer(x[i : i + 1])) for i in range(m))
            want = q8_reference(x, ref, blocks.activation_span)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
        # steps of any size run on the panels (past fused_max_tokens too: 128 for 6-8 bits), but on AMX CPUs,
        # whose bfloat16 GEMM takes steps past 128 tokens
        limit = layer.quant_method.max_tokens(layer)
        assert limit == (BF16_MIN_TOKENS if layer.quant_method.bf16_gemm else None)
        if limit is None:
            x = torch.randn(200, cols)
            out = layer(x)
            assert torch.equal(out, block_quant.matmul_q8_panels(x, layer.panels))
            assert torch.equal(out[150:151], layer(x[150:151]))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_int8_panels_same_bits_whichever_tile_runs_a_panel(qtype):
    """Threads split the panels anywhere, and a panel runs in a tile of two neighbouring panels or on its
    own (an odd one at a thread's end, or the last, partial one): one thread and two split 6 panels
    differently (AVX-512: pairs 0-1, 2-3, 4-5 against 0-1, 2 | 3-4, 5), and every output is the
    same bits either way, 4-, 5-, 6- (Q6_K) and 8-bit codes, float16, float32 and integer scales alike; and
    a batch of up to 32 rows (a decode batch: wide tiles where the machine has them) as the 70-row one."""
    if block_quant.load() is None:
        pytest.skip("no compiled kernels")
    weight, _ = random_gguf_tensor(qtype, 43, 256, np.random.default_rng(5))
    config = GGUFConfig({"w.weight": qtype}, int8_activations=True)
    layer = ReplicatedLinear(256, 43, quant_config=config, prefix="w")
    layer.weight_loader("weight", weight)
    layer.quant_method.process_after_loading(layer)
    x = torch.randn(70, 256)
    threads = torch.get_num_threads()
    try:
        for panels in filter(None, (layer.panels, panel_scales_as_float32(layer.panels))):
            torch.set_num_threads(1)
            alone = block_quant.matmul_q8_panels(x, panels)
            torch.set_num_threads(2)
            split = block_quant.matmul_q8_panels(x, panels)
            assert torch.equal(alone, split)
            assert torch.equal(alone[9:10], block_quant.matmul_q8_panels(x[9:10], panels))
            for rows in (16, 21, 24, 32):  # a decode batch's wide tiles (AVX-512: 16 rows a pair), and the rest
                assert torch.equal(alone[:rows], block_quant.matmul_q8_panels(x[:rows], panels))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q8_0", "Q4_0"])
def test_int8_panels_integer_sums_exact_for_every_code(qtype):
    """The panels' integer sums are the codes' exact dot products, every code value at every place of a
    block (5 bits: the low nibble and the fifth bit from its plane): scales 1 and integer activations
    whose blocks reach 127 round to themselves, so each output is an integer the float sums hold exactly,
    on one-row tiles, single panels and pairs (75 rows: 10 panels, the last partial)."""
    if block_quant.load() is None:
        pytest.skip("no compiled kernels")
    size, values, scale_at = _FORMAT[qtype]
    rng = np.random.default_rng(11)
    rows, cols = 75, 512
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in scale_at:
        raw[..., at : at + 2] = np.full((rows, cols // values, 1), 1.0, dtype=np.float16).view(np.uint8)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[qtype]
    ref = dequantize(raw.reshape(rows, -1), kind).reshape(rows, cols)
    codes = {"Q5_0": 32, "Q5_1": 32, "Q4_0": 16}.get(qtype)  # Q8_0: most of its 256 values a place
    for position in range(32 if codes else 0):  # every code value lies at every place of a block somewhere
        assert len(np.unique(ref.reshape(rows, -1, 32)[..., position])) == codes
    layer = ReplicatedLinear(
        cols, rows, quant_config=GGUFConfig({"w.weight": qtype}, int8_activations=True), prefix="w"
    )
    layer.weight_loader("weight", GGUFWeight("w", kind, raw.reshape(rows, -1)))
    layer.quant_method.process_after_loading(layer)
    for m in (1, 3, 9, 70):
        x = torch.randint(-127, 128, (m, cols), dtype=torch.float32)
        x[:, ::32] = 127.0  # each block's scale 127 / 127: rounding keeps x
        want = (x.double() @ torch.from_numpy(ref).double().T).float()
        assert torch.equal(block_quant.matmul_q8_panels(x, layer.panels), want)


@pytest.mark.parametrize(
    "types,bits",
    [(("Q4_K", "Q6_K"), 6), (("Q4_0", "Q5_1"), 5), (("Q6_K", "Q8_0"), 8), (("Q4_0", "Q4_K"), 4), (("Q5_0", "Q6_K"), 6)],
)
def test_fused_layers_of_mixed_types_take_the_widest_layout(types, bits):
    """q/k in Q4_K and v in Q6_K (as Q4_K_M files mix them): the fused layer holds every shard in
    the widest codes, in blocks of the smallest size, the centers as offsets where they differ —
    still exactly the file's weights, in both kernels (gguf-q8's layout, float16 scales; the exact
    mode's, float32 scales and 8-bit codes for 5 and 6 bits)."""
    from tokenmill.layers.linear import MergedColumnParallelLinear

    rng = np.random.default_rng(1)
    parts = [random_gguf_tensor(t, 32 * (i + 1), 512, rng) for i, t in enumerate(types)]
    ref = torch.cat([r for _, r in parts])
    x = torch.randn(3, 512)
    for int8_activations in (True, False):
        config = GGUFConfig({"w.gate_proj.weight": types[0], "w.up_proj.weight": types[1]}, int8_activations)
        config.packed_modules = {"gate_up_proj": ["gate_proj", "up_proj"]}
        layer = MergedColumnParallelLinear(512, [32, 64], quant_config=config, prefix="w.gate_up_proj")
        for shard, (weight, _) in enumerate(parts):
            layer.weight_loader("weight", weight, shard)
        method = layer.quant_method
        want_bits = bits if int8_activations or bits == 4 else 8
        assert method.layout.bits == want_bits and method.layout.block == (16 if "Q6_K" in types else 32)
        assert torch.equal(block_quant.dequantize(method.blocks(layer)), ref)
        want = x @ ref.T  # the float kernel, on either layout
        torch.testing.assert_close(
            block_quant.matmul(x, method.blocks(layer)), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item())
        )
        want = q8_reference(x, ref, method.blocks(layer).activation_span) if int8_activations else want
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied", "qwen2-bias"])
def test_gguf_blocks_match_transformers(tmp_path, name):
    """A GGUF file with Q4_0/Q4_1/Q8_0 tensors runs on its own blocks by default, and matches
    transformers loading the same file (dequantized to float32): logits closely, greedy exactly."""
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(make_tiny_model(name, tmp_path), tmp_path / "m.gguf", MIXED)
    path = str(tmp_path / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32")  # an explicit float32: the exact mode
    assert loaded.quantization == "gguf"
    kinds = {
        n.rsplit(".", 1)[-1]: type(m.quant_method)
        for n, m in loaded.model.named_modules()
        if n.endswith(("proj", "head"))
    }
    assert set(kinds.values()) == {BlockQuantLinearMethod}  # gate_up mixes Q4_0 and Q8_0: widened to 8 bits
    rng = random.Random(0)
    batch = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 40, 90)]
    runner = make_runner(loaded)
    for ids in batch:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(all_logits(runner, ids), ref, rtol=0, atol=1e-4 * max(1.0, ref.abs().max().item()))
    ours = run_core(
        make_core(path, loaded=loaded), batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    for i, ids in enumerate(batch):
        assert_greedy_of(hf, ids, ours[str(i)], 24)


def test_gguf_q8_tracks_the_exact_mode(tmp_path):
    """The default for a GGUF file on CPU, gguf-q8 (activations rounded to int8, a float16 KV cache),
    stays close to the exact mode (gguf, chosen by an explicit float32) but is not it."""
    write_tiny_gguf(make_tiny_model("llama-gqa-untied", tmp_path), tmp_path / "m.gguf", MIXED)
    path = str(tmp_path / "m.gguf")
    fast, exact = load_model(path), load_model(path, dtype="float32")
    assert (fast.quantization, exact.quantization) == ("gguf-q8", "gguf")
    fast_runner, exact_runner = make_runner(fast), make_runner(exact)
    # the fast mode also stores K/V in float16 by default (llama.cpp's default); the exact mode in float32
    assert (fast_runner.cache_dtype, exact_runner.cache_dtype) == (torch.float16, torch.float32)
    rng = random.Random(3)
    agree = total = 0
    for n in (1, 4, 9, 16):  # steps of at most 16 tokens take the int8 path
        ids = [rng.randrange(256) for _ in range(n)]
        a, b = all_logits(fast_runner, ids), all_logits(exact_runner, ids)
        assert ((a - b).norm() / b.norm()).item() < 0.05 and not torch.equal(a, b)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += n
    assert agree >= 0.9 * total


def test_gguf_quantization_choices(tmp_path):
    write_tiny_gguf(make_tiny_model("llama-gqa-untied", tmp_path), tmp_path / "m.gguf", MIXED)
    path = str(tmp_path / "m.gguf")
    dense = load_model(path, quantization="none")
    assert dense.quantization == "none" and not any(
        isinstance(getattr(m, "quant_method", None), BlockQuantLinearMethod) for m in dense.model.modules()
    )
    assert load_model(path, dtype="bfloat16").quantization == "none"  # auto: blocks only in float32
    assert load_model(str(tmp_path), quantization="auto").quantization == "none"  # an HF directory
    with pytest.raises(ValueError, match="quantization 'gguf' runs a GGUF file's own blocks"):
        load_model(str(tmp_path), quantization="gguf")
    with pytest.raises(
        ValueError,
        match="quantization 'gguf' runs a GGUF file's own blocks on CPU in float32; got a "
        "gguf model on cpu in torch.bfloat16",
    ):
        load_model(path, dtype="bfloat16", quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf-q8' runs a GGUF file's own blocks"):
        load_model(str(tmp_path), quantization="gguf-q8")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, gguf-q8, int8"):
        EngineConfig(quantization="q3")


def test_bfloat16_tracks_the_float_model(tmp_path):
    """bfloat16 compute (torch attention path, bf16 KV cache), through the engine."""
    make_tiny_model("qwen2-bias", tmp_path)
    ref = load_model(str(tmp_path))
    quant = load_model(str(tmp_path), dtype="bfloat16")
    assert quant.dtype == torch.bfloat16 and quant.model.lm_head.weight.dtype == torch.bfloat16
    prompts = [[(7 * i + j) % 256 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = run_core(make_core(str(tmp_path), loaded=ref), prompts, params)
    b = run_core(make_core(str(tmp_path), loaded=quant), prompts, params)
    agree = sum(x == y for k in a for x, y in zip(a[k], b[k])) / sum(len(v) for v in a.values())
    assert agree > 0.8  # near-ties may flip; the bulk of greedy tokens agree


def test_quantization_errors():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, gguf-q8, int8"):
        resolve_quantization("int3", "hf", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="quantization 'int4' runs the block kernels on CPU in float32"):
        resolve_quantization("int4", "hf", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("method", ["mxfp4", "nvfp4"])
def test_fp4_int8_activation_kernel_matches_its_torch_reference(method):
    """FP4 weights stay the formats' own nibbles (decoded through a table to twice their e2m1 value):
    MXFP4 in 4.25 bits a weight (E8M0 scale bytes), NVFP4 in 4.5 (e4m3 scale bytes, subnormal ones
    included, and a float32 factor per row); the integer kernel
    (one row, tiles, partial tiles) equals the torch rounding on the exact weights, the float kernel
    the exact product, and both dequantize to code * scale bit for bit."""
    from tokenmill.quantization import fp4
    from tokenmill.quantization.fp4 import FP4Config

    torch.manual_seed(4)
    cols = 480  # 15 groups of 32: pairs of groups, then one alone
    w = torch.randn(72, cols) * 0.05
    w[2, :32] = 0  # an all-zero block
    w[7, 100] = 3.0  # an outlier: its block's scale grows
    w[9, :32] *= 1e-4  # tiny blocks: NVFP4's e4m3 scales there are subnormal
    codes = fp4.quantize(w, method)
    scales = torch.from_numpy(codes.full_scales())
    ref = torch.from_numpy(codes.q).float() * scales.repeat_interleave(codes.block, dim=1)
    if method == "nvfp4":
        assert 0 < codes.scales[9, 0] < 2**-6  # e4m3's subnormal range
    for exact in (False, True):
        layer = ReplicatedLinear(cols, 72, quant_config=FP4Config(method, int8_activations=not exact), prefix="w")
        layer.weight_loader("weight", w)
        blocks = layer.quant_method.blocks(layer)
        assert blocks.bits == block_quant.E2M1_CODES and layer.codes.dtype == torch.uint8 and layer.high is None
        assert layer.scales.dtype == (torch.uint8 if method == "mxfp4" else torch.float8_e4m3fn)
        weight_bytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales))
        assert weight_bytes == 72 * cols * (4.25 if method == "mxfp4" else 4.5) / 8
        assert (layer.supers is None) if method == "mxfp4" else (layer.supers.shape == (72, 1))
        assert torch.equal(block_quant.dequantize(blocks), ref)
        for rows in (1, 3, 4, 7, 8, 17, 40, 300):
            x = torch.randn(rows, cols)
            if exact:
                out, want = block_quant.matmul(x, blocks), x @ ref.T
            else:
                out, want = block_quant.matmul_q8(x, blocks), q8_reference(x, ref)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
