"""Matmul on block-quantized weights on GPUs, in Triton: the `block_quant.Blocks` layout of 4- and 8-bit
codes (int8 / int4 quantized on load, AWQ, GPTQ, compressed-tensors) and of FP4 e2m1 nibbles (with
E8M0 scales, MXFP4; or e4m3 ones times a float32 factor per row, NVFP4) dequantized tile by tile inside the GEMM, w = scale * (code -
center) + offset, so the weights stay packed in GPU memory. Activations stay in the compute dtype (float16, bfloat16, or float32 with IEEE
products); accumulation in float32. 5- and 6-bit codes and K-quant super-blocks are not handled here
(GGUF files run dense on GPUs). The kernel's logic is tested on CPU under TRITON_INTERPRET=1; it has
not run on a GPU in this project's CI.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.kernels import block_quant

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # BLOCK_K: whole 32-value groups of 4-bit codes


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def block_matmul(
        x_ptr,
        codes_ptr,
        scales_ptr,
        offsets_ptr,
        rows_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_x,
        stride_c,
        stride_s,
        stride_o,
        BITS: tl.constexpr,
        BS: tl.constexpr,
        CENTER: tl.constexpr,
        HAS_OFFSETS: tl.constexpr,
        SCALES: tl.constexpr,
        IEEE: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(
                x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            wmask = (rn[:, None] < N) & (rk[None, :] < K)
            if BITS == 8:
                q = tl.load(codes_ptr + rn[:, None] * stride_c + rk[None, :], mask=wmask, other=0).to(tl.float32)
            else:  # in each 32-value group byte j holds value j (low nibble) and value j + 16 (high nibble)
                byte = (rk // 32) * 16 + rk % 16
                shift = (rk % 32) // 16 * 4
                b = tl.load(codes_ptr + rn[:, None] * stride_c + byte[None, :], mask=wmask, other=0).to(tl.int32)
                nibble = (b >> shift[None, :]) & 0xF
                if (
                    BITS == -4
                ):  # e2m1 (its code less its center): bit 3 the sign; index 0-7 -> twice 0, 0.5, 1, 1.5, 2, 3, 4, 6
                    i = nibble & 7
                    magnitude = tl.where(i < 4, i, (2 + (i & 1)) << ((i >> 1) - 1))
                    q = tl.where(nibble >= 8, -magnitude, magnitude).to(tl.float32)
                else:
                    q = nibble.to(tl.float32) - CENTER
            group = rn[:, None] * stride_s + (rk // BS)[None, :]
            if SCALES == 1:  # E8M0: scale 2^(byte - 128), built from its bits (2^-127, 2^-128: subnormal)
                e = tl.load(scales_ptr + group, mask=wmask, other=0).to(tl.int32) - 1
                bits = tl.where(e > 0, e << 23, 1 << (22 + tl.maximum(e, -1)))
                scale = bits.to(tl.float32, bitcast=True)
            elif SCALES == 2:  # e4m3 (normal: its bits rebiased by 120; subnormal: mantissa x 2^-9) x the row's factor
                m = tl.load(scales_ptr + group, mask=wmask, other=0).to(tl.int32) & 0x7F
                normal = ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True)
                scale = tl.where(m > 7, normal, m.to(tl.float32) * 0.001953125)
                scale = scale * tl.load(rows_ptr + rn, mask=rn < N, other=0.0)[:, None]
            else:
                scale = tl.load(scales_ptr + group, mask=wmask, other=0.0).to(tl.float32)
            w = q * scale
            if HAS_OFFSETS:
                w += tl.load(offsets_ptr + group, mask=wmask, other=0.0).to(tl.float32)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(
            out_ptr + rm[:, None] * stride_o + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    return block_matmul


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


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] (float16 / bfloat16 / float32) @ the dequantized weight [N, K].T -> [M, N] in x's dtype."""
    import triton

    if not supports(w):
        raise ValueError(
            f"the Triton block kernel runs 4- and 8-bit codes and e2m1 nibbles without super-blocks; got {w.bits}-bit "
            f"{'K-quant ' if w.supers is not None else ''}blocks"
        )
    x = x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kind = {torch.uint8: 1, torch.float8_e4m3fn: 2}.get(w.scales.dtype, 0)  # E8M0, e4m3, or float
    scales = w.scales.view(torch.uint8) if kind == 2 else w.scales
    offsets = w.offsets if w.offsets is not None else scales
    rows = w.supers if kind == 2 else scales  # e4m3's factor per row
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _kernel()[grid](
        x,
        w.codes,
        scales,
        offsets,
        rows,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.codes.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=w.bits,
        BS=w.block,
        CENTER=w.center,
        HAS_OFFSETS=w.offsets is not None,
        SCALES=kind,
        IEEE=x.dtype == torch.float32,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return out
