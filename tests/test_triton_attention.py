"""The Triton paged-attention kernel and backend (the GPU path), run on CPU in Triton's interpreter
(TRITON_INTERPRET=1, chosen when Triton is imported: a fresh process) against torch: the kernel against
attention written out per request, the backend inside tiny models against the torch backend, step by
step through ragged batches with decodes, chunked prefill and prefix hits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import POISONED_EMPTY

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
    reason="needs Triton",
)

ROOT = Path(__file__).resolve().parents[1]

_KERNEL = r"""
import math, torch
from tokenmill.attention import kv_quant
from tokenmill.kernels import triton_paged_attention as tpa

def reference(q, kc, vc, table, qsl, seq_lens, scale, window, cap, sinks, scales, latent_dv):
    out = []
    for r, L in enumerate(seq_lens):
        n, blocks = qsl[r + 1] - qsl[r], table[r, : -(-L // kc.shape[1])]
        rows = lambda c, s: c[blocks].flatten(0, 1)[:L].float() * (1 if s is None else s[blocks].flatten(0, 1)[:L].float()[..., None])
        k = rows(kc, None if scales is None else scales[0])
        v = k[..., :latent_dv] if latent_dv else rows(vc, None if scales is None else scales[1])
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("nhd,lhd->hnl", q[qsl[r] : qsl[r + 1]].float(), k) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        qpos, kpos = torch.arange(L - n, L)[:, None], torch.arange(L)[None]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(-1, n, 1)], -1)
        out.append(torch.einsum("hnl,lhd->nhd", s.softmax(-1)[..., :L], v))
    return torch.cat(out)

def check(new, cached, heads, kv_heads, dim, window=None, cap=None, sinks=False, cache_dtype=torch.float32,
          dtype=torch.float32, splits=1, latent_dv=None, bs=16, nblocks=40, tol=1e-5):
    g = torch.Generator().manual_seed(len(new) + sum(cached))
    seq = [c + n for c, n in zip(cached, new)]
    need = [-(-s // bs) for s in seq]
    perm = torch.randperm(nblocks, generator=g)[: sum(need)].tolist()  # random, scattered blocks
    table = torch.zeros(len(new), max(need), dtype=torch.int32)
    for r, k in enumerate(need):
        table[r, :k] = torch.tensor(perm[sum(need[:r]) : sum(need[: r + 1])])
    q = torch.randn(sum(new), heads, dim, generator=g).to(dtype)
    kvh = 1 if latent_dv else kv_heads
    kf, vf = torch.randn(2, nblocks, bs, kvh, dim, generator=g)
    scales = None
    if kv_quant.is_quantized(cache_dtype):
        (kc, ks), (vc, vs) = kv_quant.quantize(kf, cache_dtype), kv_quant.quantize(vf, cache_dtype)
        scales = torch.stack([ks, ks if latent_dv else vs])
    else:
        kc, vc = kf.to(cache_dtype), vf.to(cache_dtype)
    if latent_dv:
        vc = kc[..., :latent_dv]
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    sk = torch.randn(heads, generator=g) if sinks else None
    scale = 1 / math.sqrt(dim)
    ref = reference(q, kc, vc, table.long(), qsl, seq, scale, window, cap, sk, scales, latent_dv)
    bm = tpa.block_m_for(max(new))
    tile_req, tile_start = (torch.tensor(t, dtype=torch.int32) for t in tpa.query_tiles(qsl, bm))
    out = torch.full((sum(new), heads, latent_dv or dim), float("nan"), dtype=dtype)  # poisoned: every row written
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    got = tpa.paged_attention(q, kc, vc, table, i32(qsl), i32(seq), tile_req, tile_start, bm, scale, num_splits=splits,
                              sliding_window=window, soft_cap=cap, kv_scales=scales, sinks=sk, out=out)
    assert got is out and not got.isnan().any()
    err = (got.float() - ref).abs().max().item()
    assert err < tol, (new, cached, heads, kv_heads, window, cap, sinks, cache_dtype, dtype, splits, latent_dv, err)

check([1, 1, 7, 1, 20], [5, 40, 0, 33, 9], 4, 1, 16)               # decodes and prompt chunks (fresh, after a prefix), MQA
check([1, 1], [70, 3], 4, 4, 16, splits=3)                          # split over the key length, a split left empty
check([1, 9], [50, 30], 4, 2, 16, window=13, cap=5.0, sinks=True, splits=2)
check([3, 1], [29, 12], 6, 2, 24, bs=8)                             # head dim and group not powers of two
check([1, 5], [30, 12], 4, 2, 16, cache_dtype=torch.int8)
check([5, 1], [12, 30], 4, 2, 16, cache_dtype=torch.float8_e4m3fn)
check([1, 1], [30, 12], 4, 2, 16, cache_dtype=torch.float8_e5m2)
check([1, 5], [30, 12], 4, 2, 16, cache_dtype=torch.float16, dtype=torch.float16, tol=2e-3)
check([1, 4], [20, 6], 4, 1, 24, latent_dv=16, cache_dtype=torch.int8, splits=2)  # MLA: values = the keys' first features
print("OK")
"""

_MODELS = r"""
import os, sys, numpy as np, torch
from pathlib import Path
from helpers import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.executor.abstract import size_kv_cache
from tokenmill.loader import load_model
from tokenmill.worker.model_runner import ModelRunner

def runner(loaded, backend, cache_dtype):
    os.environ["TOKENMILL_ATTENTION_BACKEND"] = backend
    config = EngineConfig(cache=CacheConfig(num_blocks=24, block_size=4, cache_dtype=cache_dtype))
    runner = ModelRunner(loaded, config)
    runner.initialize_kv_cache(size_kv_cache(config, runner.kv_cache_specs()))  # no warm-up: the steps below
    assert runner.backend.name == backend
    return runner

# per step: (input ids per request, new tokens, cached tokens, block table); decodes first
rng = np.random.default_rng(0)
A, B = rng.integers(0, 256, 14).tolist(), rng.integers(0, 256, 11).tolist()
C = A[:8] + rng.integers(0, 256, 5).tolist()  # shares A's first two blocks: a prefix hit
STEPS = [
    ([A[:10], B[:6]], [10, 6], [0, 0], [[1, 2, 3], [4, 5]]),
    ([A[10:11], B[6:11], C[8:13]], [1, 5, 5], [10, 6, 8], [[1, 2, 3], [4, 5, 6], [1, 2, 7, 8]]),
    ([A[11:12], B[10:11], C[12:13]], [1, 1, 1], [11, 11, 13], [[1, 2, 3], [4, 5, 6], [1, 2, 7, 8]]),
]
for name, cache_dtype in [(m.split(":")[0], (m.split(":") + ["auto"])[1]) for m in sys.argv[2:]]:
    path = Path(sys.argv[1]) / name
    make_tiny_model(name, path)
    # a model each: a runner binds the model's attention layers to its own cache and backend
    ref, tri = (runner(load_model(str(path)), b, cache_dtype) for b in ("torch-sdpa", "triton-paged"))
    for ids, new, cached, tables in STEPS:
        pools = len(ref.kv_cache_config.pool_blocks)
        args = (np.array(sum(ids, [])), np.array(new), np.array(cached), [[t] * pools for t in tables])
        with torch.inference_mode():
            want, _ = ref.forward(*args)
            got, _ = tri.forward(*args)
        if cache_dtype == "auto":
            err = (got - want).abs().max().item()
            assert err < 1e-4 * max(1.0, want.abs().max().item()), (name, new, err)
        else:  # the torch backend attends a fresh prompt's own K/V, this kernel the quantized cache's
            assert ((got - want).norm() / want.norm()).item() < 0.02, (name, cache_dtype, new)
print("OK")
"""

_GRAPHS = r"""
import os, sys, numpy as np, torch
from pathlib import Path
from helpers import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.executor.abstract import size_kv_cache
from tokenmill.loader import load_model
from tokenmill.worker.cuda_graphs import DecodeGraphs, EagerGraph
from tokenmill.worker.model_runner import ModelRunner

os.environ["TOKENMILL_ATTENTION_BACKEND"] = "triton-paged"
path = Path(sys.argv[1])
make_tiny_model("llama-gqa-untied", path)
config = EngineConfig(cache=CacheConfig(num_blocks=16, block_size=4))
runners = []
for _ in range(2):  # eager, and graphs
    r = ModelRunner(load_model(str(path)), config)
    r.initialize_kv_cache(size_kv_cache(config, r.kv_cache_specs()))
    runners.append(r)
eager, graphed = runners
rng = np.random.default_rng(0)
lens = [5, 9, 3]
tables = [[[1, 2, 3]], [[4, 5, 6]], [[7, 8]]]
prompts = [rng.integers(0, 256, n) for n in lens]
with torch.inference_mode():
    for r in runners:  # the prompts, eagerly
        r.forward(np.concatenate(prompts), np.array(lens), np.zeros(3, np.int64), tables)
    graphed.decode_graphs = DecodeGraphs(graphed, max_num_seqs=4, max_model_len=32, graph_class=EagerGraph)
    graphed.decode_graphs.capture()
    assert graphed.decode_graphs.sizes == [1, 2, 4] and sorted(graphed.decode_graphs.graphs) == [1, 2, 4]
    computed = np.array(lens)
    for step, batch in enumerate([[0, 1, 2], [1]]):  # 3 decodes padded to 4, then 1
        ids = rng.integers(0, 256, len(batch))
        args = (ids, np.ones(len(batch), np.int64), computed[batch], [tables[i] for i in batch])
        want, _ = eager.forward(*args)
        got, common = graphed.forward(*args)
        assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5, step
        assert list(common.query_start_loc) == list(range(len(batch) + 1))
        computed[batch] += 1
    # the padding rows wrote nowhere: block 0 (no request's) still zero, the rest as the eager runner's
    for a, b in zip(eager.kv_caches, graphed.kv_caches):
        assert not b[:, :, 0].any() and torch.allclose(a, b, rtol=0, atol=1e-5)
print("OK")
"""

_FUSED = r"""
import torch
from tokenmill.kernels import triton_fused
from tokenmill.layers.activation import gelu_tanh_and_mul, silu_and_mul
from tokenmill.layers.norm import RMSNorm

torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):  # (the interpreter does no bfloat16 arithmetic)
    for n in (64, 100):  # a row of whole blocks, and one with a masked tail
        norm = RMSNorm(n, 1e-6).to(dtype)
        norm.weight.data.normal_(1, 0.2)
        x, res = torch.randn(5, n, dtype=dtype), torch.randn(5, n, dtype=dtype)
        want, want_sum = norm(x.clone(), res)  # the torch layer (on CPU float32: the C++ kernel)
        got, got_sum = triton_fused.add_rms_norm(x, res, norm.weight, 1e-6)
        assert torch.equal(got_sum, want_sum), (dtype, n)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), (dtype, n)
        alone, same = triton_fused.add_rms_norm(x, None, norm.weight, 1e-6)
        assert same is x and (alone.float() - norm(x.clone())[0].float()).abs().max() <= tol * want.float().abs().max()
        gate_up = torch.randn(3, 2 * n, dtype=dtype)
        got, want = triton_fused.silu_and_mul(gate_up), silu_and_mul(gate_up)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), (dtype, n, "silu")
        gate_up = gate_up * 3  # gates out to where the tanh saturates
        for approximate, want in (("tanh", gelu_tanh_and_mul(gate_up)), ("none", torch.nn.functional.gelu(gate_up[:, :n]) * gate_up[:, n:])):
            got = triton_fused.gelu_and_mul(gate_up, approximate)
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), (dtype, n, approximate)
print("OK")
"""

_MOE = r"""
import torch
from tokenmill.kernels import triton_moe
from tokenmill.layers.activation import silu_and_mul

torch.manual_seed(0)
counts = torch.tensor([5, 0, 17, 1, 0, 40])  # an idle expert, one spanning tiles, a last partial tile
E, K, I = len(counts), 48, 40
rows = torch.randn(int(counts.sum()), K)
w13, w2 = torch.randn(E, 2 * I, K) * 0.1, torch.randn(E, K, I) * 0.1
b13, b2 = torch.randn(E, 2 * I), torch.randn(E, K)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    r, a, b, c, d = (t.to(dtype) for t in (rows, w13, w2, b13, b2))
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):  # the per-expert loop of FusedMoE.run_experts
        x = r[start : start + n]
        want.append(silu_and_mul(x @ a[e].t() + c[e]) @ b[e].t() + d[e])
        start += n
    want = torch.cat(want).float()
    got = triton_moe.run_experts(r, counts, a, b, silu_and_mul, c, d).float()
    assert (got - want).abs().max() <= tol * want.abs().max(), (dtype, (got - want).abs().max())
    plain = triton_moe.run_experts(r, counts, a, b, silu_and_mul).float()
    assert plain.shape == want.shape and not plain.isnan().any()

import numpy as np
from tokenmill.kernels import block_quant, triton_block
from tokenmill.quantization.gguf import LAYOUTS, pack
from tokenmill.quantization.fp4 import LAYOUTS as FP4_LAYOUTS, quantize

def expert_blocks(n, k, layout, fp4):
    weight = torch.randn(n, k) * 0.1
    codes = quantize(weight, fp4) if fp4 else None
    if codes is None:  # a GGUF layout's codes, random in its range
        lo, hi = (-128, 128) if layout.bits == 8 else (-layout.center, 16 - layout.center)
        rng = np.random.default_rng(n * k + layout.bits)
        codes = Codes(rng.integers(lo, hi, (n, k)).astype(np.int16), rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32),
                      rng.normal(0, 0.1, (n, k // 32)).astype(np.float32) if layout.offsets else None, 32, layout.bits, layout.center)
    t = {key: None if v is None else torch.from_numpy(np.ascontiguousarray(v)) for key, v in pack(codes, layout, half=not fp4, round_half=True).items()}
    if layout.e4m3:  # NVFP4's scale bytes, as its method holds them
        t["scales"] = t["scales"].view(torch.float8_e4m3fn)
    return block_quant.Blocks(t["codes"], t["high"], t["scales"], t["offsets"], t["supers"], layout.bits, layout.center)

from tokenmill.quantization.gguf_codes import Codes
K, I = 96, 64  # K: one whole tile of 64 columns and a masked one
for layout, fp4 in ((LAYOUTS["Q4_0"], None), (LAYOUTS["Q4_1"], None), (LAYOUTS["Q8_0"], None), (FP4_LAYOUTS["mxfp4"], "mxfp4"), (FP4_LAYOUTS["nvfp4"], "nvfp4")):
    w13 = [expert_blocks(2 * I, K, layout, fp4) for _ in range(E)]
    w2 = [expert_blocks(K, I, layout, fp4) for _ in range(E)]
    x = torch.randn(int(counts.sum()), K)
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):  # the per-expert loop on the dequantized weights
        want.append(silu_and_mul(x[start : start + n] @ block_quant.dequantize(w13[e]).t()) @ block_quant.dequantize(w2[e]).t())
        start += n
    want = torch.cat(want)
    got = triton_moe.run_experts(x, counts, triton_block.stack(w13), triton_block.stack(w2), silu_and_mul)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (layout, (got - want).abs().max())
print("OK")
"""

_ROTARY = r"""
import torch
from tokenmill.attention import kv_quant
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels.triton_rotary_kv import rotary_store
from tokenmill.layers.rotary import RotaryEmbedding

def check_rotary(heads, kv_heads, dim, rotary_dim, interleaved, cache_dtype, dtype=torch.float32, bs=4, nblocks=6):
    g = torch.Generator().manual_seed(heads * dim + rotary_dim)
    rotary = RotaryEmbedding(dim, 64, 10000.0, rotary_dim=rotary_dim, interleaved=interleaved)
    qkv = torch.randn(7, heads + 2 * kv_heads, dim, generator=g).to(dtype)  # 7 tokens of any requests
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views, as the layers pass them
    positions = torch.randint(0, 64, (7,), generator=g)
    slots = torch.randperm(nblocks * bs, generator=g)[:7]
    slots[2] = -1  # a padding row: written nowhere
    shape, quantized = (2, nblocks, bs, kv_heads, dim), kv_quant.is_quantized(cache_dtype)
    poison = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) if quantized else torch.randn(shape).to(cache_dtype)
    scales = torch.randn(2, nblocks, bs, kv_heads, generator=g).to(kv_quant.SCALE_DTYPE) if quantized else None
    want_cache, got_cache = poison.clone().view(cache_dtype), poison.clone().view(cache_dtype)
    want_scales, got_scales = (None, None) if scales is None else (scales.clone(), scales.clone())
    want = rotary(positions, qk.clone())  # the torch path: rotate, then write
    keep = slots >= 0
    TorchSDPABackend()._write_kv(want[keep, heads:], v[keep], want_cache[0], want_cache[1], slots[keep], want_scales)
    q = rotary_store(qk, v, positions, rotary.table(qk), rotary_dim, interleaved, got_cache[0], got_cache[1], slots, got_scales)
    case = (heads, kv_heads, dim, rotary_dim, interleaved, cache_dtype, dtype)
    assert torch.equal(q, want[:, :heads]), case
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8)), case  # untouched slots too
    assert scales is None or torch.equal(got_scales, want_scales), case

check_rotary(4, 2, 16, 16, False, torch.float32)   # rotate-half, GQA
check_rotary(4, 2, 16, 16, True, torch.float32)    # interleaved pairs (DeepSeek's)
check_rotary(4, 1, 24, 8, False, torch.float32)    # partial rotary, MQA, head dim not a power of two
check_rotary(4, 2, 16, 16, False, torch.float16, torch.float16)
check_rotary(4, 2, 16, 12, False, torch.int8)      # quantized with their scales, bit for bit
check_rotary(4, 2, 16, 16, True, torch.float8_e4m3fn)
check_rotary(2, 2, 16, 16, False, torch.float8_e5m2)
print("OK")
"""


def _run(script: str, *args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_kernels_match_torch():
    """The attention kernel against attention written out: ragged decodes and prompt chunks over random
    block tables, GQA / MQA, key-length splits, window, soft-cap, sinks, int8 / fp8 caches, float16, the
    MLA latent layout, a NaN-poisoned output buffer. The fused residual add + RMSNorm, SiLU * up and
    GeLU * up (tanh, erf) against the torch layers (float32, float16; rows with a masked tail). The grouped
    MoE GEMM against the per-expert loop (idle experts, partial tiles, biases). The fused rotary + KV write
    against rotation then the torch write, bit for bit: rotate-half and interleaved, partial rotary, GQA /
    MQA, float16, int8 / fp8 caches with their scales, random slots with a padding row, a poisoned cache
    whose other slots stay as they were. Every float tensor `torch.empty` makes is NaN: the outputs the
    fused and MoE kernels allocate must be written whole. One process: one start-up."""
    _run(POISONED_EMPTY + _KERNEL + _FUSED + _MOE + _ROTARY)


def test_backend_matches_torch_in_models(tmp_path):
    """GQA with sinks, windows and an int8 cache (GPT-OSS), latent MLA (DeepSeek-V2), partial rotary with
    a window (Phi-3); the Llama-style layers through the fused rotary + KV write. Soft-caps are the kernel
    test's."""
    _run(_MODELS, str(tmp_path), "gpt-oss:int8", "deepseek-v2", "phi3-window-partial")


def test_decode_graphs_replay_padded_batches_as_eager(tmp_path):
    """Decode graphs (`EagerGraph` standing in for CUDA's) at padded sizes give the eager runner's hidden
    states; the padding rows write no KV (block 0, no request's, stays zero)."""
    _run(_GRAPHS, str(tmp_path))
