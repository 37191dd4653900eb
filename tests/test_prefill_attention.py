"""The C++ paged prefill attention kernel (csrc/prefill_attention.cpp) against softmax(q k^T) v in float64
over the cache's stored values, and the cpu-paged backend's prompt chunks through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention import kv_quant
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.metadata import build_common_metadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import paged_attention

pytestmark = pytest.mark.skipif(paged_attention.load() is None, reason="no CPU kernels here")

BLOCK = 16
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def paged_cache(length, kv_heads, head_dim, cache_dtype, value_dim=None, seed=0):
    """A sequence's keys and values of `length` positions in scattered blocks of a pool: (k_cache, v_cache,
    kv_scales or None, block table, keys, values as float64 [length, KVH, D] as the cache holds them)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (length + BLOCK - 1) // BLOCK
    pool = 2 * blocks + 3
    table = torch.randperm(pool, generator=gen)[:blocks]
    shape = (pool, BLOCK, kv_heads)
    k = torch.randn(*shape, head_dim, generator=gen)
    v = torch.randn(*shape, value_dim or head_dim, generator=gen)
    if cache_dtype in QUANTIZED:
        (k_cache, k_scales), (v_cache, v_scales) = kv_quant.quantize(k, cache_dtype), kv_quant.quantize(v, cache_dtype)
        scales = torch.stack((k_scales, v_scales))
        k, v = (
            kv_quant.dequantize(k_cache, k_scales, torch.float64),
            kv_quant.dequantize(v_cache, v_scales, torch.float64),
        )
    else:
        k_cache, v_cache, scales = k.to(cache_dtype), v.to(cache_dtype), None
        k, v = k_cache.double(), v_cache.double()
    rows = lambda x: x[table].reshape(-1, kv_heads, x.shape[-1])[:length]  # noqa: E731
    return k_cache, v_cache, scales, table, rows(k), rows(v)


def reference(q, keys, values, start, scale, window=None, soft_cap=None, sinks=None):
    """softmax(q k^T * scale) v in float64, query i at position start + i seeing keys 0 .. start + i (the last
    `window` of them); soft-capped scores; sinks: each head's logit in the softmax, without a value."""
    n, heads = q.shape[:2]
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos, key = start + torch.arange(n)[:, None], torch.arange(keys.shape[0])[None, :]
    seen = key <= pos
    if window:
        seen &= key > pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, n, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[0]]
    return (probs @ v).transpose(0, 1)


def check(cache_dtype, group, head_dim, start, n, kv_heads=2, window=None, soft_cap=None, sinks=False):
    k_cache, v_cache, scales, table, keys, values = paged_cache(start + n, kv_heads, head_dim, cache_dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen)
    sink = torch.randn(kv_heads * group, generator=gen) * 2 if sinks else None
    scale = head_dim**-0.5
    out = paged_attention.paged_prefill_attention(
        q, k_cache, v_cache, table, start, scale, window, soft_cap, scales, sink
    )
    ref = reference(q, keys, values, start, scale, window, soft_cap, sink)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, *QUANTIZED])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start, n", [(0, 45), (37, 50)])
def test_paged_prefill_attention_matches_float64_softmax(cache_dtype, group, head_dim, start, n):
    """Every cache dtype (int8 / fp8 with their scales), GQA groups of 1, 3 (SmolLM2) and 7 (Qwen2.5), a
    chunk at the start and one after cached tokens, both across block and key-tile boundaries."""
    check(cache_dtype, group, head_dim, start, n)


@pytest.mark.parametrize(
    "window, soft_cap, sinks",
    [(24, None, False), (9, 1.5, False), (None, 2.0, False), (None, None, True), (40, None, True)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8])
def test_paged_prefill_attention_with_window_soft_cap_and_sinks(window, soft_cap, sinks, cache_dtype):
    """A sliding window (narrower and wider than a key tile), Gemma 2's soft-cap, GPT-OSS's sinks; a head dim
    off the vector width (72: AVX-512's 16 lanes)."""
    check(cache_dtype, 3, 72, 53, 70, window=window, soft_cap=soft_cap, sinks=sinks)


def test_paged_prefill_attention_reads_a_latent_cache():
    """MLA's absorbed prefill: one kv head of latent + rope features, the values a strided view of its rows."""
    latent, rope, start, n = 48, 16, 20, 40
    k_cache, _, _, table, keys, _ = paged_cache(start + n, 1, latent + rope, torch.float32)
    q = torch.randn(n, 5, latent + rope)
    out = paged_attention.paged_prefill_attention(q, k_cache, k_cache[..., :latent], table, start, 0.1)
    ref = reference(q, keys, keys[..., :latent], start, 0.1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_paged_prefill_attention_reads_the_chunks_own_keys_and_values_as_computed(cache_dtype):
    """`new_kv` (a quantized cache's first chunk, as the torch path attends it): the chunk's rows are read
    from the float32 K/V given (strided views of a fused qkv output), the earlier ones from the cache."""
    start, n, kv_heads = 37, 50, 2
    k_cache, v_cache, scales, table, keys, values = paged_cache(start + n, kv_heads, 64, cache_dtype)
    q, k_new, v_new = torch.randn(n, 6 + 2 * kv_heads, 64).split([6, kv_heads, kv_heads], 1)
    out = paged_attention.paged_prefill_attention(
        q, k_cache, v_cache, table, start, 0.125, kv_scales=scales, new_kv=(k_new, v_new)
    )
    keys[start:], values[start:] = k_new, v_new
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, 0.125), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_dtype, window", [(torch.float16, None), (torch.int8, 50), (torch.float32, 7)])
def test_paged_prefill_attention_of_a_row_depends_on_neither_the_chunks_nor_the_threads(cache_dtype, window):
    """A 300-token prompt attended in one chunk, or cut into chunks anywhere (a chunk's keys and values are
    in the cache before it attends), at 1, 2 or 3 threads: every row the same bits."""
    length = 300
    k_cache, v_cache, scales, table, _, _ = paged_cache(length, 3, 64, cache_dtype)
    q = torch.randn(length, 9, 64)
    threads = torch.get_num_threads()

    def attend(cuts):
        edges = [0, *cuts, length]
        return torch.cat(
            [
                paged_attention.paged_prefill_attention(
                    q[a:b], k_cache, v_cache, table[: (b + BLOCK - 1) // BLOCK], a, 0.125, window, None, scales
                )
                for a, b in zip(edges, edges[1:])
            ]
        )

    try:
        torch.set_num_threads(1)
        whole = attend([])
        runs = []
        for count, cuts in ((2, []), (3, []), (1, [17]), (2, [1, 100, 130, 131, 250]), (3, [64, 200, 299])):
            torch.set_num_threads(count)
            runs.append(attend(cuts))
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        assert torch.equal(run, whole)


def test_cpu_paged_prompt_chunks_match_the_torch_path():
    """Through the backends: a step with a decode, a first chunk and a chunk after 40 cached tokens; the
    cpu-paged backend's kernels (prefill from the cache) against the torch path (gather + SDPA), float32."""
    kv_heads, group, head_dim, computed, new = 2, 3, 32, np.array([20, 0, 40]), np.array([1, 30, 25])
    blocks = [[5, 1], [2, 7], [0, 3, 4, 6, 8]]
    common, _ = build_common_metadata(new, computed, blocks, BLOCK, torch.device("cpu"))
    tokens = int(new.sum())
    q, k, v = (torch.randn(tokens, h, head_dim) for h in (kv_heads * group, kv_heads, kv_heads))
    torch.manual_seed(0)
    cache = torch.randn(2, 9, BLOCK, kv_heads, head_dim)
    outs = []
    for backend in (CpuPagedBackend(), TorchSDPABackend()):
        meta = backend.build_metadata(common)
        outs.append(backend.forward(q, k, v, cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
