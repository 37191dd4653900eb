"""`gpu_check.py`'s kernel section: each fused or tuned Triton kernel of the GPU path against the torch (or
unfused) path it replaces, at Llama-3-8B's shapes: its largest error against that path (PASS / FAIL) and
both times, medians of timed repeats after a warm-up that also runs the autotuner. Off CUDA it runs only
under TRITON_INTERPRET=1 (set before Triton is imported), on tiny shapes, to check the code paths.

- rotary + KV write: `triton_rotary_kv.rotary_store` vs the rotation then the KV-write kernel;
- GeLU * up (tanh) vs torch's gelu and product;
- the int4 block GEMM, one row: split-K (as chosen) vs one slice of K, and a dense bfloat16 matmul;
- fp8 weights in 128x128 blocks: the Triton GEMM vs dequantizing per call, and `_scaled_mm` (row-wise
  scales) where the GPU has fp8 tensor cores;
- int4 MoE experts: the grouped block GEMM (one launch per projection) vs the per-expert loop;
- FlashAttention / FlashInfer decode over the paged cache vs the Triton paged kernel, where installed.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(report, name: str, got, want, tol: float, fast, slow, device, repeats: int, what: str) -> None:
    """Report `got` against `want` (relative to want's largest value) and the two paths' times."""
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()
    t_fast, t_slow = timed(fast, device, repeats), timed(slow, device, repeats)
    status = "PASS" if err <= tol else "FAIL"
    detail = f"{t_fast * 1e6:.1f} us vs {t_slow * 1e6:.1f} us {what} ({t_slow / t_fast:.2f}x); max rel err {err:.2e}"
    report(name, status, detail, us=t_fast * 1e6, baseline_us=t_slow * 1e6, err=err)


def kernels(args, report) -> None:
    device, dry = torch.device(args.device), args.dry_run
    if device.type != "cuda" and importlib.util.find_spec("triton") is None:
        report("kernels", "SKIP", "needs triton")
        return
    if device.type != "cuda" and not _interpreted():
        report("kernels", "SKIP", "the Triton kernels run on CPU only under TRITON_INTERPRET=1")
        return
    h, kvh, d, hidden, inter, tokens, repeats = (4, 2, 32, 128, 256, 4, 2) if dry else (32, 8, 128, 4096, 14336, 64, 50)
    dtype = torch.float16 if device.type != "cuda" else torch.bfloat16  # the interpreter does no bfloat16 math
    torch.manual_seed(0)
    for name, run in (
        ("rotary+kv write", lambda: _rotary(report, device, dtype, h, kvh, d, tokens, repeats)),
        ("gelu*up", lambda: _gelu(report, device, dtype, inter, tokens, repeats)),
        ("int4 GEMM", lambda: _block_gemm(report, device, dtype, hidden, repeats)),
        ("fp8 GEMM", lambda: _fp8(report, device, dtype, hidden, repeats)),
        ("grouped int4 MoE", lambda: _grouped_moe(report, device, dtype, hidden, inter, tokens, repeats)),
        ("library attention", lambda: _library_attention(report, device, dtype, h, kvh, d, tokens, repeats, dry)),
    ):
        try:  # one kernel's failure is reported, the others still run
            run()
        except Exception as e:
            report(f"kernel {name}", "FAIL", f"{type(e).__name__}: {e}")


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _rotary(report, device, dtype, h, kvh, d, tokens, repeats) -> None:
    from tokenmill.kernels import triton_paged_attention, triton_rotary_kv
    from tokenmill.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(d, 8192, 500000.0)
    qkv = torch.randn(tokens, h + 2 * kvh, d, dtype=dtype, device=device)
    qk, v = qkv[:, : h + kvh], qkv[:, h + kvh :]
    positions = torch.randint(0, 8192, (tokens,), device=device)
    slots = torch.randperm(1024 * 16, device=device)[:tokens]
    caches = torch.zeros(2, 2, 1024, 16, kvh, d, dtype=dtype, device=device)
    table = rotary.table(qk)

    def fused():
        return triton_rotary_kv.rotary_store(qk, v, positions, table, d, False, caches[0, 0], caches[0, 1], slots)

    def unfused():
        q, k = rotary(positions, qk).split([h, kvh], dim=1)
        triton_paged_attention.write_kv(k, v, caches[1, 0], caches[1, 1], slots)
        return q

    got, want = fused(), unfused()
    tol = 1e-2
    compare(report, f"kernel rotary+kv write ({tokens} tokens)", got, want, tol, fused, unfused, device, repeats,
            "rotation then KV write")  # fmt: skip
    if not torch.allclose(caches[0].float(), caches[1].float(), rtol=tol, atol=tol):
        report("kernel rotary+kv write: cache", "FAIL", "the fused kernel's cache differs from the unfused one")


def _gelu(report, device, dtype, inter, tokens, repeats) -> None:
    from tokenmill.kernels import triton_fused

    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)

    def torch_path():
        return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]

    def fused():
        return triton_fused.gelu_and_mul(gate_up, "tanh")

    compare(report, f"kernel gelu*up ({tokens} x {inter})", fused(), torch_path(), 1e-2, fused, torch_path, device,
            repeats, "torch")  # fmt: skip


def _block_gemm(report, device, dtype, hidden, repeats) -> None:
    from tokenmill.kernels import block_quant, triton_block

    n = k = hidden
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k // 32, device=device) * 0.01).to(torch.float16)
    w = block_quant.Blocks(codes, None, scales, None, None, 4, 8)
    x = torch.randn(1, k, dtype=dtype, device=device)
    dense = torch.randn(n, k, dtype=dtype, device=device)
    split = triton_block.split_k_for(1, n, k, 2 * _sms(device))
    want = triton_block.matmul(x, w, split_k=1)
    compare(report, f"kernel int4 GEMM 1x{k}x{n} split-K {split}", triton_block.matmul(x, w), want, 1e-2,
            lambda: triton_block.matmul(x, w), lambda: triton_block.matmul(x, w, split_k=1), device, repeats,
            "one slice")  # fmt: skip
    compare(report, f"kernel int4 GEMM 1x{k}x{n} vs dense", want, want, 1.0, lambda: triton_block.matmul(x, w),
            lambda: x @ dense.t(), device, repeats, f"dense {str(dtype).split('.')[-1]}")  # fmt: skip


def _grouped_moe(report, device, dtype, hidden, inter, tokens, repeats) -> None:
    """Block-quantized experts (int4, Mixtral's 8 choose 2): one grouped launch per projection vs the loop
    over the experts that reads the counts back (the per-layer device sync it removes)."""
    from tokenmill.kernels import block_quant, triton_block, triton_moe
    from tokenmill.layers.activation import silu_and_mul

    def experts(n, k):
        return [
            block_quant.Blocks(
                torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device),
                None,
                (torch.rand(n, k // 32, device=device) * 0.01).to(torch.float16),
                None,
                None,
                4,
                8,
            )
            for _ in range(8)
        ]

    w13, w2 = experts(2 * inter, hidden), experts(hidden, inter)
    stacked13, stacked2 = triton_block.stack(w13), triton_block.stack(w2)
    counts = torch.bincount(torch.randint(0, 8, (2 * tokens,), device=device), minlength=8)
    rows = torch.randn(2 * tokens, hidden, dtype=dtype, device=device)

    def grouped():
        return triton_moe.run_experts(rows, counts, stacked13, stacked2, silu_and_mul)

    def loop():
        out, start = torch.empty_like(rows), 0
        for e, n in enumerate(counts.tolist()):
            part = rows[start : start + n]
            out[start : start + n] = triton_block.matmul(silu_and_mul(triton_block.matmul(part, w13[e])), w2[e])
            start += n
        return out

    compare(report, f"kernel grouped int4 MoE ({2 * tokens} rows, 8 experts, {hidden}/{inter})", grouped(), loop(),
            2e-2, grouped, loop, device, repeats, "per-expert loop")  # fmt: skip


def _fp8(report, device, dtype, hidden, repeats) -> None:
    from tokenmill.kernels import triton_block
    from tokenmill.quantization import fp8

    n = k = hidden
    weight, _ = fp8.quantize(torch.randn(n, k, device=device) * 0.05)
    scales = torch.rand(n, -(-k // 128), device=device) * 0.01 + 1e-3  # a 128-column block scale per row
    ref_w = weight.float() * scales.repeat_interleave(128, 1)[:, :k]
    for m in (1, 64):
        x = torch.randn(m, k, dtype=dtype, device=device)

        def per_call():
            return F.linear(x, (weight.float() * scales.repeat_interleave(128, 1)[:, :k]).to(dtype))

        def fused():
            return triton_block.fp8_matmul(x, weight, scales, 128)

        compare(report, f"kernel fp8 block GEMM {m}x{k}x{n}", fused(), x.float() @ ref_w.t(), 2e-2, fused, per_call,
                device, repeats, "dequantizing per call")  # fmt: skip
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and dtype == torch.bfloat16:
            rows = scales[:, :1].contiguous()
            want = x.float() @ (weight.float() * rows).t()
            compare(report, f"kernel fp8 _scaled_mm {m}x{k}x{n}", fp8.scaled_mm_linear(x, weight, rows, None, dtype),
                    want, 0.1, lambda: fp8.scaled_mm_linear(x, weight, rows, None, dtype), fused, device, repeats,
                    "the Triton fp8 GEMM")  # fmt: skip


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128


def _library_attention(report, device, dtype, h, kvh, d, tokens, repeats, dry) -> None:
    """A decode batch of `tokens` requests of 1,024 cached tokens each (64 on a dry run)."""
    from tokenmill.attention.metadata import build_common_metadata
    from tokenmill.attention.triton_paged import TritonPagedBackend

    for name, package in (("flash-attn", "flash_attn"), ("flashinfer", "flashinfer")):
        if device.type != "cuda" or importlib.util.find_spec(package) is None:
            report(f"kernel {name} decode", "SKIP", f"needs CUDA and the {package} package")
            continue
        from tokenmill.attention.library_backends import FlashAttnBackend, FlashInferBackend

        bs, context = 256, 64 if dry else 1024
        per_req = -(-(context + 1) // bs)
        blocks = np.random.default_rng(0).permutation(tokens * per_req).reshape(tokens, per_req).tolist()
        common, _ = build_common_metadata(
            np.ones(tokens, np.int64), np.full(tokens, context, np.int64), blocks, bs, device
        )
        cache = torch.randn(2, tokens * per_req, bs, kvh, d, dtype=dtype, device=device)
        q = torch.randn(tokens, h, d, dtype=dtype, device=device)
        lib = (FlashAttnBackend if name == "flash-attn" else FlashInferBackend)(dtype, dtype)
        tri = TritonPagedBackend()
        lib_meta, tri_meta = lib.build_metadata(common), tri.build_metadata(common)
        scale = d**-0.5

        def library():
            return lib._attend(q, cache[0], cache[1], lib_meta, scale, None, None, None)

        def triton_paged():
            return tri._attend(q, cache[0], cache[1], tri_meta, scale, None, None, None)

        compare(report, f"kernel {name} decode ({tokens} x {context})", library(), triton_paged(), 2e-2, library,
                triton_paged, device, repeats, "triton-paged")  # fmt: skip
