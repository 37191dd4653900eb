"""The Triton kernel of `triton_block.py` (imported only where Triton is installed): the block-quantized
GEMM, the tile configurations it is tuned over, and the 64-bit row offsets it addresses weights with."""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def tile_configs() -> list[tuple[int, int, int, int, int]]:
    """(BM, BN, BK, warps, stages) the autotuner tries, per bucket of M and each N, K, split: small-M tiles
    for decodes, wide ones for prefill (BK: whole 32-value groups of 4-bit codes). One in Triton's
    interpreter, where tuning would only cost time."""
    if INTERPRETED:
        return [(16, 64, 64, 4, 1)]
    return [
        (16, 64, 64, 4, 4),
        (16, 128, 128, 4, 4),
        (16, 256, 64, 8, 3),
        (32, 64, 128, 4, 4),
        (64, 64, 64, 4, 3),
        (64, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
    ]


@triton.jit
def row_offsets(rows, stride):
    """Element offsets of `rows` in a matrix of row stride `stride`, in 64 bits: an LM head's N * K
    exceeds 2^31 (and int32 products wrap)."""
    return rows.to(tl.int64) * stride


@triton.jit
def e4m3_magnitude(m):
    """|value| of e4m3fn bytes' low 7 bits `m` (int32): a normal's bits rebiased by 120 into a float32, a
    subnormal's mantissa times 2^-9 (decoded from bits, which Triton's interpreter runs too)."""
    normal = ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(m > 7, normal, m.to(tl.float32) * 0.001953125)


@triton.jit
def weight_tile(
    codes_ptr, scales_ptr, offsets_ptr, rows_ptr, code_rows, scale_rows, rn, rk, wmask, N,
    BITS: tl.constexpr, BS: tl.constexpr, CENTER: tl.constexpr, HAS_OFFSETS: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """The float32 weights [BN, BK] of rows `rn` and columns `rk` decoded from their blocks: codes (8-bit,
    4-bit nibbles, e2m1 nibbles, e4m3 bytes) times their block's scale (float, E8M0, or e4m3 times the
    row's factor), plus its offset. `code_rows` / `scale_rows`: the rows' 64-bit offsets."""
    if BITS == 8:
        q = tl.load(codes_ptr + code_rows + rk[None, :], mask=wmask, other=0).to(tl.float32)
    elif BITS == -8:  # e4m3fn weights (the fp8 method), read as bytes: bit 7 the sign
        b = tl.load(codes_ptr + code_rows + rk[None, :], mask=wmask, other=0).to(tl.int32) & 0xFF
        magnitude = e4m3_magnitude(b & 0x7F)
        q = tl.where(b >= 128, -magnitude, magnitude)
    else:  # in each 32-value group byte j holds value j (low nibble) and value j + 16 (high nibble)
        byte = (rk // 32) * 16 + rk % 16
        shift = (rk % 32) // 16 * 4
        b = tl.load(codes_ptr + code_rows + byte[None, :], mask=wmask, other=0).to(tl.int32)
        nibble = (b >> shift[None, :]) & 0xF
        if BITS == -4:  # e2m1 (its code less its center): bit 3 the sign; index 0-7 -> twice 0, 0.5, 1, 1.5, 2, 3, 4, 6
            i = nibble & 7
            magnitude = tl.where(i < 4, i, (2 + (i & 1)) << ((i >> 1) - 1))
            q = tl.where(nibble >= 8, -magnitude, magnitude).to(tl.float32)
        else:
            q = nibble.to(tl.float32) - CENTER
    group = scale_rows + (rk // BS)[None, :]
    if SCALES == 1:  # E8M0: scale 2^(byte - 128), built from its bits (2^-127, 2^-128: subnormal)
        e = tl.load(scales_ptr + group, mask=wmask, other=0).to(tl.int32) - 1
        bits = tl.where(e > 0, e << 23, 1 << (22 + tl.maximum(e, -1)))
        scale = bits.to(tl.float32, bitcast=True)
    elif SCALES == 2:  # e4m3 (normal: its bits rebiased by 120; subnormal: mantissa x 2^-9) x the row's factor
        scale = e4m3_magnitude(tl.load(scales_ptr + group, mask=wmask, other=0).to(tl.int32) & 0x7F)
        scale = scale * tl.load(rows_ptr + rn, mask=rn < N, other=0.0)[:, None]
    else:
        scale = tl.load(scales_ptr + group, mask=wmask, other=0.0).to(tl.float32)
    w = q * scale
    if HAS_OFFSETS:
        w += tl.load(offsets_ptr + group, mask=wmask, other=0.0).to(tl.float32)
    return w


@triton.jit
def accumulate(acc, x_ptrs, x_mask, w, IEEE: tl.constexpr):
    """`acc` plus this K tile's activations (masked loads as zeros) times the decoded weight tile `w`,
    in float32 with IEEE products (the exact mode) or in the activations' dtype."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if IEEE:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.autotune(
    configs=[
        triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in tile_configs()
    ],
    key=["M_BUCKET", "N", "K", "SPLIT_K"],
)
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
    stride_split,
    M_BUCKET,
    SPLIT_K: tl.constexpr,
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
    code_rows, scale_rows = row_offsets(rn, stride_c)[:, None], row_offsets(rn, stride_s)[:, None]
    # this program's slice of K (whole BK tiles; all of K without split-K)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BK) * BK
    k_lo = tl.program_id(2) * chunk
    k_hi = tl.minimum(K, k_lo + chunk)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        wmask = (rn[:, None] < N) & (rk[None, :] < k_hi)
        w = weight_tile(
            codes_ptr, scales_ptr, offsets_ptr, rows_ptr, code_rows, scale_rows, rn, rk, wmask, N,
            BITS, BS, CENTER, HAS_OFFSETS, SCALES,
        )  # fmt: skip
        x_mask = (rm[:, None] < M) & (rk[None, :] < k_hi)
        acc = accumulate(acc, x_ptr + row_offsets(rm, stride_x)[:, None] + rk[None, :], x_mask, w, IEEE)
    tl.store(  # split-K: this slice's partial sums, in float32, reduced after
        out_ptr + tl.program_id(2).to(tl.int64) * stride_split + row_offsets(rm, stride_o)[:, None] + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def grouped_block_matmul(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, rows_ptr, out_ptr, counts_ptr, starts_ptr, tile_starts_ptr,
    tile_expert_ptr, N, K, E, stride_x, stride_ce, stride_c, stride_se, stride_s, stride_re, stride_o,
    BITS: tl.constexpr, BS: tl.constexpr, CENTER: tl.constexpr, HAS_OFFSETS: tl.constexpr, SCALES: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """`block_matmul` for an MoE layer's experts in one launch: the rows come sorted by expert (counts[e]
    of them for expert e), each tile of BM rows lies within one expert (`triton_moe.tile_map`, worked out
    on the device) and multiplies that expert's blocks, found at e times their expert stride."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        local = (tile - tl.load(tile_starts_ptr + e)) * BM + tl.arange(0, BM)  # rows within expert e
        row_ok = local < tl.load(counts_ptr + e)
        rm = tl.load(starts_ptr + e) + local
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        e64 = e.to(tl.int64)
        code_rows, scale_rows = row_offsets(rn, stride_c)[:, None], row_offsets(rn, stride_s)[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            w = weight_tile(
                codes_ptr + e64 * stride_ce, scales_ptr + e64 * stride_se, offsets_ptr + e64 * stride_se,
                rows_ptr + e64 * stride_re, code_rows, scale_rows, rn, rk, (rn[:, None] < N) & (rk[None, :] < K), N,
                BITS, BS, CENTER, HAS_OFFSETS, SCALES,
            )  # fmt: skip
            x_mask = row_ok[:, None] & (rk[None, :] < K)
            acc = accumulate(acc, x_ptr + row_offsets(rm, stride_x)[:, None] + rk[None, :], x_mask, w, IEEE)
        tl.store(
            out_ptr + row_offsets(rm, stride_o)[:, None] + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (rn[None, :] < N),
        )
