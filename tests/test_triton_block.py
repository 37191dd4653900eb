"""The Triton block-quantized matmul (the GPU path of the int8 / int4 / AWQ / GPTQ / compressed-tensors /
FP4 weights), run on CPU under TRITON_INTERPRET=1 in a fresh process (the interpreter is chosen when
Triton is imported), against the C++ kernels' dequantized weight of the same blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import POISONED_EMPTY

from tokenmill.kernels import block_quant, triton_block

pytestmark = pytest.mark.skipif(
    not triton_block.available() or block_quant.load() is None,
    reason="needs Triton and the C++ kernels (the reference)",
)

_CHECK = r"""
import numpy as np, torch
from tokenmill.kernels import block_quant, triton_block
from tokenmill.quantization.gguf import BlockLayout, pack
from tokenmill.quantization.gguf_codes import Codes

rng = np.random.default_rng(0)
# (bits, block, center, offsets, float16 scales): Q4_0-like, Q4_1-like (int4 asym, AWQ), 8-bit (int8,
# GPTQ 8-bit), 8-bit codes per 16 with float32 scales (NVFP4 as held), 4-bit with float32 scales
LAYOUTS = [(4, 32, 8, False, True), (4, 32, 0, True, True), (8, 32, 0, False, True), (8, 16, 0, False, False),
           (4, 32, 0, True, False)]
for bits, block, center, offsets, half in LAYOUTS:
    n, k = 70, 160  # a partial tile of rows and of columns
    lo, hi = (-128, 128) if bits == 8 else (-center, 16 - center)
    codes = Codes(rng.integers(lo, hi, (n, k)).astype(np.int16), rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float32),
                  rng.normal(0, 0.1, (n, k // block)).astype(np.float32) if offsets else None, block, bits, center)
    arrays = pack(codes, BlockLayout(bits, block, offsets, center), half=half, round_half=True)
    t = {key: None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for key, a in arrays.items()}
    w = block_quant.Blocks(t["codes"], t["high"], t["scales"], t["offsets"], t["supers"], bits, center)
    assert triton_block.supports(w)
    ref_w = block_quant.dequantize(w)
    for m, dtype, tol in ((1, torch.float32, 1e-5), (19, torch.float32, 1e-5), (5, torch.float16, 2e-2)):
        x = torch.randn(m, k)
        got = triton_block.matmul(x.to(dtype), w)
        assert got.dtype == dtype and got.shape == (m, n)
        ref = x.to(dtype).float() @ (ref_w.to(dtype).float() if dtype != torch.float32 else ref_w).T
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (bits, block, center, offsets, half, m, dtype, err)
        if m == 1:  # split-K: three slices of K (the last one short), partial sums reduced in float32
            split = triton_block.matmul(x.to(dtype), w, split_k=3)
            err = ((split.float() - ref).abs().max() / ref.abs().max()).item()
            assert split.dtype == dtype and err < tol, (bits, block, center, offsets, half, dtype, "split", err)

from tokenmill.quantization.fp8 import quantize
torch.manual_seed(0)
for group in (160, 128):  # fp8 weights per channel, and per 128 columns (a partial last block)
    weight, _ = quantize(torch.randn(70, 160) * 0.05)
    weight.view(torch.uint8)[0, :8] = torch.tensor([0, 1, 7, 8, 0x80, 0x81, 0x7E, 0xFE], dtype=torch.uint8)  # subnormals, ±max
    scales = torch.rand(70, -(-160 // group)) * 0.01 + 1e-3
    ref_w = (weight.float() * scales.repeat_interleave(group, 1)[:, :160])
    assert torch.equal(triton_block.fp8_matmul(torch.eye(160), weight, scales, group).T, ref_w)  # every weight decoded
    for m, split, dtype, tol in ((1, 3, torch.float32, 1e-5), (19, 1, torch.float32, 1e-5), (5, 1, torch.float16, 2e-2)):
        x = torch.randn(m, 160).to(dtype)
        got = triton_block.fp8_matmul(x, weight, scales, group, split_k=split)
        ref = x.float() @ (ref_w.to(dtype).float()).T
        assert got.dtype == dtype and ((got.float() - ref).abs().max() / ref.abs().max()).item() < tol, (group, m)

import triton, triton.language as tl
from tokenmill.kernels.triton_block_kernel import row_offsets

@triton.jit
def probe(rows_ptr, out_ptr, stride):
    i = tl.arange(0, 4)
    tl.store(out_ptr + i, row_offsets(tl.load(rows_ptr + i), stride))

rows = torch.tensor([0, 1, 151_935, 262_143], dtype=torch.int32)  # an LM head's last rows
out = torch.zeros(4, dtype=torch.int64)
probe[(1,)](rows, out, 16_384)  # K = 16384 bytes a row: N * K > 2^31, past int32
assert out.tolist() == [r * 16_384 for r in rows.tolist()], out
print("OK")
"""


def test_triton_kernel_matches_the_dequantized_blocks():
    """Every block layout against the dequantized weight: one row (also split over K), many rows, float16;
    fp8 e4m3 weights (every byte decoded, subnormals and the largest values included; per-channel and
    128-column scales); and the kernel's row offsets in 64 bits at an LM head's rows past 2^31 elements.
    Outputs (split-K partials included) start as NaN: every element must be written."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", POISONED_EMPTY + _CHECK], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


_MODEL = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from helpers import all_logits, make_runner, make_tiny_model
from tokenmill.loader import load_model
from tokenmill.quantization import gguf

make_tiny_model("qwen2-bias", sys.argv[2])  # q/k/v biases
ids = [3, 17, 99, 5, 250, 64, 7]
for quantization in ("int4", "int8", "nvfp4", "mxfp4"):  # FP4: e2m1 nibbles (MXFP4's scales E8M0)
    loaded = load_model(sys.argv[2], quantization=quantization, dtype="float32")  # float32 activations: exact
    cpp = all_logits(make_runner(loaded), ids)
    gguf.runs_triton = lambda x: True
    triton = all_logits(make_runner(loaded), ids)
    gguf.runs_triton = lambda x: False
    torch.testing.assert_close(triton, cpp, rtol=0, atol=1e-4 * float(cpp.abs().max()))

make_tiny_model("mixtral", sys.argv[2] + "/moe")  # MXFP4 experts: every expert of a layer in one grouped launch
loaded = load_model(sys.argv[2] + "/moe", quantization="mxfp4", dtype="float32")
cpp = all_logits(make_runner(loaded), ids)
gguf.runs_triton = lambda x: True
triton = all_logits(make_runner(loaded), ids)
gguf.runs_triton = lambda x: False
moe = loaded.model.model.layers[0].mlp.experts
assert moe.stacked_blocks is not None and moe.w13[1].codes.untyped_storage().data_ptr() == moe.stacked_blocks[0].codes.data_ptr()
torch.testing.assert_close(triton, cpp, rtol=0, atol=1e-4 * float(cpp.abs().max()))
print("OK")
"""


def test_a_quantized_model_runs_the_triton_path_like_the_cpu_kernels(tmp_path):
    """Every linear layer of a tiny model (int4 with its int8 LM head, int8, NVFP4, MXFP4; biases) through the Triton
    kernel, in the interpreter: the logits of the C++ kernels on the same blocks. A Mixtral's MXFP4 experts through
    the grouped kernel (their blocks stacked once, the experts' buffers views of the stack): the same."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", _MODEL, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


_FP4 = r"""
import torch
from tokenmill.kernels import block_quant, triton_block
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.quantization import fp4
from tokenmill.quantization.fp4 import FP4Config

torch.manual_seed(0)
# an MXFP4 checkpoint's tensor (as GPT-OSS stores it), scale bytes from E8M0's subnormal end (0, 1) up
blocks = torch.randint(0, 256, (70, 5, 16), dtype=torch.uint8)
scales = torch.randint(0, 140, (70, 5), dtype=torch.uint8)
scales[0, :2] = torch.tensor([0, 1])
values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
nibbles = torch.stack((blocks & 15, blocks >> 4), -1).view(70, 5, 32).long()
exact = (values[nibbles] * torch.exp2(scales.double() - 127)[..., None].float()).view(70, 160)
w = torch.randn(70, 160) * 0.05
w[3, :32] *= 3e-5  # NVFP4: two blocks whose e4m3 scales are subnormal
for method in ("mxfp4", "nvfp4"):
    layer = ReplicatedLinear(160, 70, quant_config=FP4Config(method, False), prefix="w")
    if method == "mxfp4":
        layer.quant_method.load(layer, fp4.e8m0_codes(blocks, scales), slice(None), slice(None), slice(None))
    else:
        layer.weight_loader("weight", w)
    b = layer.quant_method.blocks(layer)
    assert b.bits == block_quant.E2M1_CODES and triton_block.supports(b)
    ref = block_quant.dequantize(b)
    if method == "mxfp4":
        assert torch.equal(ref, exact)
    else:
        assert layer.scales.dtype == torch.float8_e4m3fn and 0 < layer.scales[3, :2].float().max() < 2**-6
        codes = fp4.quantize(w, method)
        assert torch.equal(ref, torch.from_numpy(codes.q * codes.full_scales().repeat(16, axis=1)).float())
    for m in (1, 19):
        x = torch.randn(m, 160)
        got, want = triton_block.matmul(x, b), x @ ref.T
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (method, m)
    decoded = triton_block.matmul(torch.eye(160), b).T  # every weight, as the kernel decodes it
    assert torch.equal(decoded, ref), method
print("OK")
"""


def test_triton_kernel_reads_fp4_nibbles_and_their_scale_bytes():
    """MXFP4 (E8M0 scales, subnormal ones included) and NVFP4 (e4m3 scale bytes, subnormal ones included,
    times a float32 factor per row) as the GPU path holds them (the same nibbles and scale bytes as on
    CPU): the Triton kernel decodes every weight to the C++ kernels' values."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _FP4], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_split_k_goes_to_narrow_decodes_and_tiles_tune_per_bucket():
    """Split-K only where few rows meet a long K and the row tiles alone would not fill the device; the
    autotuner's M key is a power-of-two bucket."""
    assert triton_block.split_k_for(1, 4096, 4096, 264) == 4  # 64 tiles of N: K in four slices of 1024
    assert triton_block.split_k_for(1, 1024, 14336, 264) == 14  # a narrow, deep down projection
    assert triton_block.split_k_for(1, 151_936, 4096, 264) == 1  # an LM head fills the device alone
    assert triton_block.split_k_for(32, 4096, 4096, 264) == 1  # prefill
    assert triton_block.split_k_for(1, 4096, 1024, 264) == 1  # too short a K to slice
    assert [triton_block.m_bucket(m) for m in (1, 3, 16, 17, 1000)] == [1, 4, 16, 32, 256]
    done = subprocess.run(  # one tile config in the interpreter, several to tune over on a GPU
        [sys.executable, "-c", "from tokenmill.kernels import triton_block_kernel as k; print(len(k.tile_configs()))"],
        capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120,
    )  # fmt: skip
    assert done.stdout.split() == ["1"], done.stderr[-2000:]


def test_triton_kernel_refuses_layouts_it_lacks():
    import torch

    w = block_quant.Blocks(
        torch.zeros(4, 128, dtype=torch.uint8),
        torch.zeros(4, 32, dtype=torch.uint8),
        torch.zeros(4, 8, dtype=torch.int8),
        None,
        torch.zeros(4, 1, 2, dtype=torch.float16),
        6,
        32,
    )
    assert not triton_block.supports(w)
    with pytest.raises(ValueError, match="without super-blocks; got 6-bit K-quant blocks"):
        triton_block.matmul(torch.zeros(1, 256), w)
