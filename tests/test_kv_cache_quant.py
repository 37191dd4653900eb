"""Quantized KV caches (int8, fp8 e4m3 / e5m2 with per-token-per-head scales): the quantizer's error,
the C++ decode kernel against the torch path on the same quantized blocks, a tiny model's logits
against a float32 cache, capacity, the block pool after requests, and bad input."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest
import torch
from helpers import make_core, make_runner, make_tiny_model, run_core

from tokenmill.attention import kv_quant
from tokenmill.attention.kv_spec import AttentionSpec, make_kv_cache_config
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import CacheConfig, resolve_cache_dtype
from tokenmill.engine_args import add_engine_args
from tokenmill.kernels import paged_attention
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# |x - dequantize(quantize(x))| <= rel * |x| + abs * scale: int8 rounds to the nearest step (half a
# scale); fp8 to 3 (e4m3) or 2 (e5m2) mantissa bits, subnormals below 2^-6 / 2^-14 in steps of 2^-9 / 2^-16
BOUNDS = {torch.int8: (0.0, 0.5), torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17)}
needs_kernel = pytest.mark.skipif(paged_attention.load() is None, reason="no C++ compiler here")


@pytest.mark.parametrize("dtype", QUANTIZED.values())
def test_round_trip_error_is_bounded(dtype):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-4, 3, 50)[:, None, None]  # rows of every magnitude
    x[0, 0] = 0.0  # an all-zero row stays zero
    values, scales = kv_quant.quantize(x, dtype)
    assert values.dtype == dtype and scales.shape == (50, 3) and scales.dtype == kv_quant.SCALE_DTYPE
    back = kv_quant.dequantize(values, scales, torch.float32)
    rel, abs_ = BOUNDS[dtype]
    bound = rel * x.abs() + abs_ * scales.float()[..., None]
    assert (back - x).abs().le(bound * (1 + 1e-6)).all()
    assert back[0, 0].eq(0).all() and back.isfinite().all()
    assert values.float().abs().amax(-1).ge(kv_quant.QUANT_MAX[dtype] * 0.99)[1:].all()  # each row uses the range


def quantized_cache(dtype, num_blocks, block_size, kv_heads, head_dim, seed=0):
    """Random K/V written through the quantizer into every slot: (k_cache, v_cache, scales [2, ...])."""
    torch.manual_seed(seed)
    k_cache, v_cache = (torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    scales = torch.zeros(2, num_blocks, block_size, kv_heads, dtype=kv_quant.SCALE_DTYPE)
    slots = torch.randperm(num_blocks * block_size)
    for cache, s in ((k_cache, scales[0]), (v_cache, scales[1])):
        kv_quant.write(torch.randn(len(slots), kv_heads, head_dim) * 2, cache, s, slots)
    return k_cache, v_cache, scales


@needs_kernel
@pytest.mark.parametrize("dtype", QUANTIZED.values())
@pytest.mark.parametrize("head_dim, group", [(16, 1), (20, 3), (64, 3), (64, 7), (24, 16)])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (9, 1.5)])
def test_kernel_matches_the_torch_path_on_quantized_blocks(dtype, head_dim, group, window, soft_cap):
    """The compiled decode kernel and the torch backend's gather + dequantize + SDPA, on the same blocks."""
    kv_heads, block_size, num_blocks = 2, 16, 48
    k_cache, v_cache, scales = quantized_cache(dtype, num_blocks, block_size, kv_heads, head_dim)
    lengths = torch.tensor([1, 9, 16, 33, 130])
    tables = torch.randperm(num_blocks)[: len(lengths) * 9].view(len(lengths), 9)
    q = torch.randn(len(lengths), kv_heads * group, head_dim)
    out = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.3, window, soft_cap, scales)
    keys = torch.arange(9 * block_size)[None, :]
    mask = (keys < lengths[:, None]) & (keys >= lengths[:, None] - (window or 10**9))
    meta = argparse.Namespace(decode_block_tables=tables, decode_mask=mask[:, None, None, :])
    ref = TorchSDPABackend()._decode(q, k_cache, v_cache, meta, 0.3, soft_cap, scales)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", QUANTIZED.values())
def test_kernel_writer_gives_the_torch_quantizers_bytes(dtype):
    """The C++ writer (the CPU backend's and the compiled decode step's) and `kv_quant.write`: the
    same bytes and scales, for rows of every magnitude, all-zero rows, exact halves (int8 ties) and
    strided views of a fused qkv output."""
    torch.manual_seed(1)
    kv_heads, head_dim, blocks, bs = 3, 20, 6, 4
    qkv = torch.randn(17, 2 + 2 * kv_heads, head_dim) * torch.logspace(-30, 6, 17)[:, None, None]
    qkv[3] = 0.0
    qkv[5, :, :2] = torch.tensor([127.0, 0.5])  # scale 1: codes 127 and a tie at 0.5
    k, v = qkv[:, 2 : 2 + kv_heads], qkv[:, 2 + kv_heads :]
    slots = torch.randperm(blocks * bs)[:17]
    caches = [
        (
            torch.zeros(blocks, bs, kv_heads, head_dim, dtype=dtype),
            torch.zeros(blocks, bs, kv_heads, head_dim, dtype=dtype),
            torch.zeros(2, blocks, bs, kv_heads, dtype=kv_quant.SCALE_DTYPE),
        )
        for _ in range(2)
    ]
    (kc, vc, sc), (rk, rv, rs) = caches
    paged_attention.write_kv_quantized(k, v, kc, vc, sc, slots)
    kv_quant.write(k, rk, rs[0], slots)
    kv_quant.write(v, rv, rs[1], slots)
    for ours, ref in ((kc, rk), (vc, rv), (sc, rs)):
        assert torch.equal(
            ours.view(torch.uint8) if ours.element_size() == 1 else ours.view(torch.int16),
            ref.view(torch.uint8) if ref.element_size() == 1 else ref.view(torch.int16),
        )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_decodes_every_fp8_code_exactly(dtype):
    """One token attended (weight exactly 1): the output is its value row times its scale, for all 256
    byte codes (subnormals included; NaN and infinity left out), in the vector loop (8 | 256) and the tail."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = torch.where(codes.float().isfinite(), codes.float(), 0.0).to(dtype)
    for width in (256, 252):
        v_cache = codes[:width].view(1, 1, 1, width)
        k_cache = torch.zeros_like(v_cache)
        scales = torch.full((2, 1, 1, 1), 0.375, dtype=kv_quant.SCALE_DTYPE)
        out = paged_attention.paged_decode_attention(
            torch.randn(1, 1, width),
            k_cache,
            v_cache,
            torch.zeros(1, 1, dtype=torch.long),
            torch.tensor([1]),
            0.1,
            kv_scales=scales,
        )
        torch.testing.assert_close(out[0, 0], v_cache.flatten().float() * 0.375, rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvquant-model")
    make_tiny_model("llama-gqa-untied", directory)
    return str(directory), load_model(str(directory))


PROMPT = np.random.RandomState(0).randint(0, 256, 70).tolist()


def chunked_logits(runner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of `ids` prefilled `chunk` tokens per step: every chunk after the first
    reads the earlier ones from the cache (chunk 1: every token a decode)."""
    blocks = list(range(-(-len(ids) // runner.kv_cache_config.block_size)))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            hidden, _ = runner.forward(np.array(ids[start:end]), np.array([end - start]), np.array([start]), [[blocks]])
            out.append(runner.model.compute_logits(hidden).float())
    return torch.cat(out)


def assert_close_to_a_float32_cache(loaded, name: str, chunk: int, limit: float) -> None:
    """Top-1 agreement >= 90% and a max difference within `limit` x max|logit| against a float32 cache,
    on the default CPU backend and on the torch path (which must agree with each other to float rounding)."""
    ref = chunked_logits(make_runner(loaded, cache_dtype="float32"), PROMPT, chunk)
    runner = make_runner(loaded, cache_dtype=name)
    assert runner.backend.name == ("cpu-paged" if paged_attention.load() else "torch-sdpa")
    got = chunked_logits(runner, PROMPT, chunk)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("tokenmill.worker.model_runner.get_attention_backend", lambda *a: TorchSDPABackend())
        torch_path = chunked_logits(make_runner(loaded, cache_dtype=name), PROMPT, chunk)
    for logits in (got, torch_path):
        assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
        assert (logits - ref).abs().max() <= limit * ref.abs().max()
    torch.testing.assert_close(got, torch_path, rtol=1e-4, atol=1e-4)


# prompt chunks over cached blocks (torch path), short ones (per-token kernel decodes), decodes
@pytest.mark.parametrize("chunk", [24, 8, 1])
@pytest.mark.parametrize("name", QUANTIZED)
def test_logits_stay_close_to_a_float32_cache(tiny, name, chunk):
    _, loaded = tiny
    scales = make_runner(loaded, cache_dtype=name).kv_scales[0]
    assert scales.shape == (2, 2, 32, 16, 2)  # [layers, K/V, blocks, block size, kv heads]
    assert_close_to_a_float32_cache(loaded, name, chunk, {"int8": 0.03, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}[name])


@pytest.mark.parametrize("name", QUANTIZED)
def test_latent_mla_cache_takes_one_scale_per_row(tmp_path, name):
    """DeepSeek-V2's latent cache quantized: one scale per token row (values are its leading features,
    read with the same scale), over prompt chunks, short chunks and decodes. One scale covers the whole
    40-value row (latent and rotary part): fp8's error is about 1.5x a per-head row's."""
    make_tiny_model("deepseek-v2", tmp_path)
    loaded = load_model(str(tmp_path))
    assert make_runner(loaded, cache_dtype=name).kv_scales[0].shape[1:] == (1, 32, 16, 1)  # one row, one head
    for chunk in (24, 8, 1):
        assert_close_to_a_float32_cache(loaded, name, chunk, {"int8": 0.03, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}[name])


@pytest.mark.parametrize("name", QUANTIZED)
def test_prefix_cached_requests_leave_the_pool_whole(tiny, name):
    """Chunked prefill with prefix-cache hits over quantized blocks; the greedy tokens mostly match a
    float32 cache's (int8: all but rare near-ties), and every block is free afterwards."""
    directory, loaded = tiny
    prefix = PROMPT[:48]
    prompts = [prefix + [i, i + 1, i + 2] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for dtype in ("float32", name):
        core = make_core(directory, loaded=loaded, cache_dtype=dtype, max_num_batched_tokens=20)
        first, rest = run_core(core, prompts[:1], params)["0"], run_core(core, prompts[1:], params)  # then hits
        outputs[dtype] = [first] + [rest[str(i)] for i in range(3)]
        assert core.kv.prefix_hits == 3 * 48 and core.kv.num_free_blocks == core.kv.num_blocks
    same = [a == b for got, ref in zip(outputs[name], outputs["float32"]) for a, b in zip(got, ref)]
    assert len(same) == 24 and sum(same) >= (0.9 if name == "int8" else 0.5) * len(same)


def test_capacity_doubles_against_a_16_bit_cache(tiny, caplog):
    """SmolLM2-135M's shape: 30 layers of 3 kv heads of 64; scales cost 2 bytes per 64-byte row."""

    def per_token(dtype):
        return sum(AttentionSpec(3, 64, dtype).bytes_per_token for _ in range(30))

    def capacity(dtype):
        specs = {f"l{i}": AttentionSpec(3, 64, dtype) for i in range(30)}
        return make_kv_cache_config(specs, CacheConfig(kv_cache_memory_gib=1.0)).capacity_tokens

    assert per_token(torch.float16) == 23040 and per_token(torch.float32) == 46080
    for dtype in QUANTIZED.values():
        assert per_token(dtype) == 30 * 2 * 3 * (64 + 2)
        assert capacity(dtype) >= 1.9 * capacity(torch.float16) and capacity(dtype) >= 3.8 * capacity(torch.float32)
    _, loaded = tiny
    with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
        runner = make_runner(loaded, num_blocks=8, cache_dtype="int8")  # what is allocated is what the spec counts
    allocated = sum(t.numel() * t.element_size() for t in runner.kv_caches + runner.kv_scales)
    assert allocated == runner.kv_cache_config.total_bytes
    assert runner.kv_cache_config.bytes_per_token == 2 * 2 * 2 * (16 + 2)  # layers, K/V, kv heads, row
    assert f"torch.int8: 144 bytes and {2**30 // 144} tokens per GiB" in caplog.text


def test_info_shows_tokens_per_gib_for_each_dtype(tiny, tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    main(["info", "--model", tiny[0], "--kv-cache-dtype", "fp8_e5m2"])
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["KV bytes per token"].strip() == "144 (torch.float8_e5m2)"
    assert rows["KV tokens per GiB"].strip() == (
        f"{2**30 // 144:,} (torch.float8_e5m2); float32 {2**30 // 512:,}, "
        f"float16/bfloat16 {2**30 // 256:,}, int8 {2**30 // 144:,}, "
        f"fp8 {2**30 // 144:,}"
    )
    make_tiny_model("deepseek-v2", tmp_path)  # a latent cache: one row of 40 values a token and layer
    main(["info", "--model", str(tmp_path)])
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["KV tokens per GiB"].strip().endswith(f"int8 {2**30 // (2 * 42):,}, fp8 {2**30 // (2 * 42):,}")


def test_bad_dtypes_fail_clearly(capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of .*int8.*got 'int4'"):
        CacheConfig(cache_dtype="int4")
    with pytest.raises(ValueError, match="got 'fp4'"):
        resolve_cache_dtype("fp4", torch.float32)
    assert resolve_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert all(name in " ".join(parser.format_help().split()) for name in ("int8", "fp8_e4m3", "fp8_e5m2"))
