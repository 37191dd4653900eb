"""Matmul on block-quantized weights on GPUs, in Triton: the `block_quant.Blocks` layout of 4- and 8-bit
codes (int8 / int4 quantized on load, AWQ, GPTQ, compressed-tensors) and of FP4 e2m1 nibbles (with
E8M0 scales, MXFP4; or e4m3 ones times a float32 factor per row, NVFP4) dequantized tile by tile inside the GEMM, w = scale * (code -
center) + offset, so the weights stay packed in GPU memory. Activations stay in the compute dtype (float16, bfloat16, or float32 with IEEE
products); accumulation in float32. The fp8 method's e4m3 weights (per-channel or 128x128 block scales)
run through the same kernel (`fp8_matmul`), decoded from their bytes with the scales applied per tile. 5- and 6-bit codes and K-quant super-blocks are not handled here
(GGUF files run dense on GPUs). Tiles are autotuned per bucket of M and each N and K (one config in
the interpreter); few rows over a long K (a decode) are split over K, each slice's partial sums reduced
after in float32 (deterministic, unlike atomics); row offsets are 64-bit, as an LM head's N * K passes
2^31. The kernel's logic is tested on CPU under TRITON_INTERPRET=1; it has not run on a GPU in this
project's CI.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import block_quant

E4M3_BYTES = -8  # the kernel's `BITS` for float8 e4m3 weights (the fp8 method's), read as bytes
SPLIT_K_MIN = 1024  # split-K never leaves a slice of K shorter than this
GROUPED_BM, GROUPED_BN = 16, 64  # the grouped (MoE) kernel's tile: rows of one expert, output columns


def m_bucket(m: int) -> int:
    """The autotuner's key for M: its power of two up to 256 (one tuning per bucket, not per batch size)."""
    return min(256, 1 << max(0, m - 1).bit_length())


def split_k_for(m: int, n: int, k: int, programs: int) -> int:
    """Slices of K for few rows over a long K (a one-row decode: N / 64 programs would leave most of the
    device idle on a narrow matrix), so that about `programs` programs run; 1 for prefill or a short K."""
    if m > 16 or k < 2 * SPLIT_K_MIN:
        return 1
    return max(1, min(k // SPLIT_K_MIN, -(-programs // -(-n // 64)), 16))


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(w) -> bool:
    """Whether `w` (a `block_quant.Blocks`) is a layout this kernel runs."""
    e2m1 = w.bits == block_quant.E2M1_CODES
    if e2m1 and w.scales.dtype == torch.float8_e4m3fn:  # NVFP4: a float32 factor per row in `supers`
        return w.high is None and w.supers is not None and w.supers.dtype == torch.float32
    return (
        (w.bits in (4, 8) or e2m1)
        and w.high is None
        and w.supers is None
        and w.scales.dtype in ((torch.float16, torch.float32) + ((torch.uint8,) if e2m1 else ()))
    )


def matmul(x: torch.Tensor, w, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (float16 / bfloat16 / float32) @ the dequantized weight [N, K].T -> [M, N] in x's dtype.
    `split_k`: slices of K, each program's partial sums reduced after in float32 (None: `split_k_for`)."""
    if not supports(w):
        raise ValueError(
            f"the Triton block kernel runs 4- and 8-bit codes and e2m1 nibbles without super-blocks; got {w.bits}-bit "
            f"{'K-quant ' if w.supers is not None else ''}blocks"
        )
    kind = {torch.uint8: 1, torch.float8_e4m3fn: 2}.get(w.scales.dtype, 0)  # E8M0, e4m3, or float
    scales = w.scales.view(torch.uint8) if kind == 2 else w.scales
    rows = w.supers if kind == 2 else scales  # e4m3's factor per row
    return _launch(x, w.codes, scales, w.offsets, rows, w.bits, w.block, w.center, kind, split_k)


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int, split_k: int | None = None
) -> torch.Tensor:
    """x [M, K] @ (e4m3 `weight` [N, K] times float32 `scales` [N, ceil(K / group)]).T -> [M, N] in x's dtype:
    the fp8 method's layout (per channel: group K; per 128x128 block: 128), the scales applied in the K
    loop, the weight never dequantized in memory."""
    return _launch(x, weight.view(torch.uint8), scales, None, scales, E4M3_BYTES, group, 0, 0, split_k)


def stack(experts: list[block_quant.Blocks]) -> block_quant.Blocks:
    """Experts' blocks of one layout as one `Blocks` of [E, ...] tensors, for `grouped_matmul`."""
    first = experts[0]
    fields = {
        name: None if getattr(first, name) is None else torch.stack([getattr(w, name) for w in experts])
        for name in ("codes", "high", "scales", "offsets", "supers")
    }
    return block_quant.Blocks(**fields, bits=first.bits, center=first.center)


def grouped_matmul(x: torch.Tensor, w, counts: torch.Tensor, maps) -> torch.Tensor:
    """x [R, K] (rows grouped by expert, counts[e] rows for expert e) -> [R, N]: each row times its expert's
    dequantized weight, transposed. `w`: a `block_quant.Blocks` of every expert's blocks stacked ([E, N, ...]
    each tensor); `maps`: `triton_moe.tile_map(counts, R, GROUPED_BM)`. Nothing waits for the counts."""
    import triton

    from tokenmill.kernels.triton_block_kernel import grouped_block_matmul

    if not supports(w):
        raise ValueError(f"the grouped Triton block kernel runs the layouts of `matmul`; got {w.bits}-bit blocks")
    kind = {torch.uint8: 1, torch.float8_e4m3fn: 2}.get(w.scales.dtype, 0)
    scales = w.scales.view(torch.uint8) if kind == 2 else w.scales
    rows = w.supers if kind == 2 else scales
    offsets = w.offsets if w.offsets is not None else scales
    x = x.contiguous()
    (r, k), n = x.shape, w.codes.shape[1]
    starts, tile_starts, tile_expert, max_tiles = maps
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    grouped_block_matmul[(max_tiles, triton.cdiv(n, GROUPED_BN))](
        x, w.codes, scales, offsets, rows, out, counts, starts, tile_starts, tile_expert, n, k, counts.numel(),
        x.stride(0), w.codes.stride(0), w.codes.stride(1), scales.stride(0), scales.stride(1), rows.stride(0),
        out.stride(0), BITS=w.bits, BS=k // scales.shape[-1], CENTER=w.center, HAS_OFFSETS=w.offsets is not None,
        SCALES=kind, IEEE=x.dtype == torch.float32, BM=GROUPED_BM, BN=GROUPED_BN, BK=64,
    )  # fmt: skip
    return out


def _launch(x, codes, scales, offsets, rows, bits, block, center, scale_kind, split_k):
    import triton

    from tokenmill.kernels.triton_block_kernel import block_matmul

    x = x.contiguous()
    (m, k), n = x.shape, codes.shape[0]
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 128
        split_k = split_k_for(m, n, k, 2 * sms)
    if split_k > 1:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]), split_k)  # noqa: E731
    block_matmul[grid](
        x, codes, scales, offsets if offsets is not None else scales, rows, out, m, n, k,
        x.stride(0), codes.stride(0), scales.stride(0), out.stride(-2), m * n, m_bucket(m),
        SPLIT_K=split_k, BITS=bits, BS=block, CENTER=center, HAS_OFFSETS=offsets is not None, SCALES=scale_kind,
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out.sum(0).to(x.dtype) if split_k > 1 else out
