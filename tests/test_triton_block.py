"""The Triton block-quantized matmul (the GPU path of the int8 / int4 / AWQ / GPTQ / compressed-tensors /
FP4 weights), run on CPU under TRITON_INTERPRET=1 in a fresh process (the interpreter is chosen when
Triton is imported), against the C++ kernels' dequantized weight of the same blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.kernels import block_quant, triton_block

pytestmark = pytest.mark.skipif(not triton_block.available() or block_quant.load() is None,
                                reason="needs Triton and the C++ kernels (the reference)")

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
print("OK")
"""


def test_triton_kernel_matches_the_dequantized_blocks():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


_MODEL = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from helpers import all_logits, make_runner, make_tiny_model
from tokenmill.loader import load_model
from tokenmill.quantization import gguf

make_tiny_model("qwen2-bias", sys.argv[2])  # q/k/v biases
ids = [3, 17, 99, 5, 250, 64, 7]
for quantization in ("int4", "int8", "nvfp4"):  # float32 activations widen NVFP4's codes to 8 bits
    loaded = load_model(sys.argv[2], quantization=quantization, dtype="float32")  # float32 activations: exact
    cpp = all_logits(make_runner(loaded), ids)
    gguf.runs_triton = lambda x: True
    triton = all_logits(make_runner(loaded), ids)
    gguf.runs_triton = lambda x: False
    torch.testing.assert_close(triton, cpp, rtol=0, atol=1e-4 * float(cpp.abs().max()))
print("OK")
"""


def test_a_quantized_model_runs_the_triton_path_like_the_cpu_kernels(tmp_path):
    """Every linear layer of a tiny model (int4 with its int8 LM head, int8, NVFP4; biases) through the Triton
    kernel, in the interpreter: the logits of the C++ kernels on the same blocks."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _MODEL, str(Path(__file__).parent), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_triton_kernel_refuses_layouts_it_lacks():
    import torch

    w = block_quant.Blocks(torch.zeros(4, 128, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8),
                           torch.zeros(4, 8, dtype=torch.int8), None, torch.zeros(4, 1, 2, dtype=torch.float16), 6, 32)
    assert not triton_block.supports(w)
    with pytest.raises(ValueError, match="runs 4- and 8-bit codes without super-blocks; got 6-bit K-quant blocks"):
        triton_block.matmul(torch.zeros(1, 256), w)
