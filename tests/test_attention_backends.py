"""FlashAttention and FlashInfer as attention backends, without either library (neither is installed
here, nor a GPU): `--attention-backend` picks them by name and refuses them at start off CUDA or without
their package, naming it; the backends refuse what they cannot read; and their per-step metadata, built
from the runner's step description, says what the Triton backend's says (same requests, lengths and
blocks)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tokenmill.attention.metadata import build_common_metadata
from tokenmill.attention.selector import get_attention_backend
from tokenmill.config import check_attention_backend
from tokenmill.engine_args import EngineArgs, add_engine_args

pytest.importorskip("triton")  # the two backends write their caches with the Triton backend's kernels
from tokenmill.attention import library_backends as lib  # noqa: E402
from tokenmill.attention.triton_paged import TritonPagedBackend  # noqa: E402

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def test_the_flag_names_a_backend_and_refuses_one_that_cannot_run_here():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--attention-backend", "flash-attn"]))
    with pytest.raises(ValueError, match="attention_backend flash-attn runs on CUDA; the device is cpu"):
        args.create_engine_config()
    with pytest.raises(SystemExit):  # argparse: not a backend
        parser.parse_args(["--attention-backend", "flash"])
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch-sdpa"):
        check_attention_backend("flash", torch.device("cpu"))
    check_attention_backend("triton-paged", CUDA)  # no package of its own to check


@pytest.mark.parametrize("name,package", [("flash-attn", "flash_attn"), ("flashinfer", "flashinfer")])
def test_a_library_backend_without_its_package_is_refused_naming_it(name, package):
    try:
        __import__(package)
        pytest.skip(f"{package} is installed here")
    except ImportError:
        pass
    with pytest.raises(
        ValueError, match=f"attention_backend {name} needs the {package} package, which is not installed"
    ):
        check_attention_backend(name, CUDA)


def test_selection_by_name_env_and_device(monkeypatch):
    bf16 = torch.bfloat16
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "torch-sdpa")
    assert get_attention_backend(CUDA, bf16, bf16).name == "torch-sdpa"  # auto: the environment's
    assert get_attention_backend(CUDA, bf16, bf16, "flash-attn").name == "flash-attn"  # the flag wins
    assert get_attention_backend(CUDA, bf16, bf16, "flashinfer").name == "flashinfer"
    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND")
    assert get_attention_backend(CUDA, bf16, bf16).name == "triton-paged"  # never chosen unasked


def test_library_backends_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="flash-attn runs float16 / bfloat16 compute over a cache of the same dtype"):
        lib.FlashAttnBackend(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="flashinfer runs float16"):
        lib.FlashInferBackend(torch.bfloat16, torch.int8)  # a quantized cache
    flash = lib.FlashAttnBackend(torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="blocks of a multiple of 256 tokens; --block-size is 16"):
        flash.kv_cache_shape(8, 16, None)

    class Layer:
        layer_name, sliding_window, logits_soft_cap, sinks, latent_rope_dim = "l0", None, None, None, 64

    with pytest.raises(ValueError, match="does not read MLA latent caches"):
        flash.check_layer(Layer())
    Layer.latent_rope_dim, Layer.sinks = None, torch.zeros(4)
    with pytest.raises(ValueError, match="flash-attn does not support sinks"):
        flash.check_layer(Layer())


def _step(block_size: int):
    """Decodes and prompt chunks (fresh, after a prefix), over random scattered blocks."""
    rng = np.random.default_rng(0)
    new, computed = np.array([1, 1, 7, 20]), np.array([5, 40, 0, 33])
    need = -(-(new + computed) // block_size)
    perm = rng.permutation(64)
    blocks = [perm[sum(need[:r]) : sum(need[: r + 1])].tolist() for r in range(len(new))]
    common, _ = build_common_metadata(new, computed, blocks, block_size, torch.device("cpu"))
    return common, TritonPagedBackend().build_metadata(common, sliding_window=13)


def test_flash_attn_metadata_says_what_the_triton_backend_builds():
    common, tri = _step(16)
    meta = lib.FlashAttnBackend(torch.bfloat16, torch.bfloat16).build_metadata(common, sliding_window=13)
    assert torch.equal(meta.cu_seqlens_q, tri.query_start_loc) and meta.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(meta.cu_seqlens_k.diff(), tri.seq_lens) and meta.cu_seqlens_k[0] == 0
    assert torch.equal(meta.block_table, tri.block_table) and meta.block_table.dtype == torch.int32
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (20, 53)
    assert meta.slot_mapping is tri.slot_mapping and meta.sliding_window == tri.sliding_window == 13


def test_flashinfer_pages_are_each_requests_used_blocks():
    common, tri = _step(16)
    backend = lib.FlashInferBackend(torch.bfloat16, torch.bfloat16)
    meta = backend.build_metadata(common)
    assert torch.equal(meta.qo_indptr, tri.query_start_loc)
    indptr, indices, last = meta.kv_indptr.tolist(), meta.kv_indices, meta.last_page_len.tolist()
    for r, length in enumerate(tri.seq_lens.tolist()):
        pages = indptr[r + 1] - indptr[r]
        assert torch.equal(indices[indptr[r] : indptr[r + 1]], tri.block_table[r, :pages])  # in order, no padding
        assert (pages - 1) * 16 + last[r] == length and 1 <= last[r] <= 16
    assert indptr[-1] == len(indices) and backend.build_metadata(common).step == meta.step + 1  # a plan per step
    _, indices, last = lib.paged_kv_pages(np.array([[3, 9, 0]]), np.array([32]), 16)  # a last page exactly full
    assert indices.tolist() == [3, 9] and last.tolist() == [16]
