"""Rotary embedding and the KV-cache write as one Triton kernel (the GPU path): each program takes one
token's row of one head (queries and keys stacked, as the layers project them), rotates it at the
token's position, and writes a query row to the output, or a key row (and the same kv head's value row)
into the paged cache at the token's slot. Unfused, the same step is a rotation (five to seven torch
kernels: two gathers of the table, halves, products, concatenations) and a scatter per cache.

The rotation is the layers' (`layers/rotary.py`): rotate-half pairs (i, i + rot/2), or interleaved pairs
(2i, 2i + 1) written back in rotate-half order, on the first `rotary_dim` features (the rest copied),
with the layer's precomputed cos/sin table. It rounds as torch does in half precision (each product,
then their sum, to the dtype), so both paths give the same keys. An int8 / fp8 cache gets each row
quantized as `attention/kv_quant.py` does, bit for bit: scale = max|x| / qmax rounded to bfloat16 (to
nearest even, from its bits), x / scale rounded to nearest even (int8) or encoded into e4m3 / e5m2 bits
(the cache's bytes), which Triton's interpreter runs too. A negative slot (a CUDA graph's padding row)
is written nowhere. Tested on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_paged_attention import KV_FLOAT, KV_INT8, KV_KINDS


@triton.jit
def round_half_even(x):
    """x to the nearest integer, ties to even (torch.round's rule), for |x| < 2^22."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 y (within the format's range) -> its fp8 byte (MANT mantissa bits, exponent bias BIAS),
    rounded to nearest even: normals by rounding the float32 mantissa, subnormals as integer multiples
    of the smallest subnormal (a carry into the exponent falls out of both)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 128, 0)
    a = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANT
    normal = ((a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) - ((127 - BIAS) << MANT)
    tiny = tl.minimum(a.to(tl.float32, bitcast=True), 2.0 ** (1 - BIAS))  # (normals clamped: not used)
    sub = round_half_even(tiny * (2.0 ** (BIAS - 1 + MANT))).to(tl.int32)
    return (sign | tl.where((a >> 23) > 127 - BIAS, normal, sub)).to(tl.uint8)


@triton.jit
def encode(x, scale, KIND: tl.constexpr, QMAX: tl.constexpr, out_ty):
    """A float32 row piece as the cache stores it: the cache's float type, or quantized by its scale."""
    if KIND == 0:
        return x.to(out_ty)
    y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
    if KIND == 1:
        return round_half_even(y).to(tl.int8)
    if KIND == 2:
        return fp8_bits(y, 3, 7)
    return fp8_bits(y, 2, 15)


@triton.jit
def bf16_scale(amax, QMAX: tl.constexpr):
    """(the row's scale max|x| / qmax rounded to bfloat16 as int16 bits, that scale in float32)."""
    s = tl.maximum(amax / QMAX, 7.888609052210118e-31)  # 2^-100: an all-zero row
    b = s.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.to(tl.int16), (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def rotary_store_kernel(
    qk_ptr, v_ptr, pos_ptr, cs_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr,
    stride_qkt, stride_qkh, stride_vt, stride_vh, stride_qt, stride_qh, stride_cs, stride_pos,
    stride_kc, stride_kch, stride_vc, stride_vch, stride_sc,
    H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, KIND: tl.constexpr,
    QMAX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    half: tl.constexpr = ROT // 2
    row = qk_ptr + t * stride_qkt + h * stride_qkh
    p = tl.arange(0, BLOCK_HALF)
    p_ok = p < half
    if INTERLEAVED:
        i1, i2 = 2 * p, 2 * p + 1
    else:
        i1, i2 = p, p + half
    x1 = tl.load(row + i1, mask=p_ok, other=0.0)
    x2 = tl.load(row + i2, mask=p_ok, other=0.0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cs_ptr + pos * stride_pos + p, mask=p_ok, other=0.0).to(tl.float32)
    s = tl.load(cs_ptr + stride_cs + pos * stride_pos + p, mask=p_ok, other=0.0).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    ty = x1.dtype  # each product rounded to the dtype, then their sum: torch's roundings
    o1 = ((x1f * c).to(ty).to(tl.float32) - (x2f * s).to(ty).to(tl.float32)).to(ty)
    o2 = ((x2f * c).to(ty).to(tl.float32) + (x1f * s).to(ty).to(tl.float32)).to(ty)
    j = ROT + tl.arange(0, BLOCK_D)  # the features that do not rotate
    rest_ok = j < D
    rest = tl.load(row + j, mask=rest_ok, other=0.0)
    if h < H:
        out = q_ptr + t * stride_qt + h * stride_qh
        tl.store(out + p, o1, mask=p_ok)
        tl.store(out + half + p, o2, mask=p_ok)
        tl.store(out + j, rest, mask=rest_ok)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # a negative slot: a padding row, written nowhere
            kh = h - H
            k1, k2, k_rest = o1.to(tl.float32), o2.to(tl.float32), rest.to(tl.float32)
            scale = 1.0
            if KIND != 0:  # the row's scale from its largest magnitude (rotated, rounded to the dtype)
                amax = tl.maximum(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)), tl.max(tl.abs(k_rest), 0))
                bits, scale = bf16_scale(amax, QMAX)
                tl.store(ks_ptr + slot * stride_sc + kh, bits)
            dst = k_cache_ptr + slot * stride_kc + kh * stride_kch
            ty_c = k_cache_ptr.dtype.element_ty
            tl.store(dst + p, encode(k1, scale, KIND, QMAX, ty_c), mask=p_ok)
            tl.store(dst + half + p, encode(k2, scale, KIND, QMAX, ty_c), mask=p_ok)
            tl.store(dst + j, encode(k_rest, scale, KIND, QMAX, ty_c), mask=rest_ok)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < D
            v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + d, mask=d_ok, other=0.0).to(tl.float32)
            scale_v = 1.0
            if KIND != 0:
                bits_v, scale_v = bf16_scale(tl.max(tl.abs(v), 0), QMAX)
                tl.store(vs_ptr + slot * stride_sc + kh, bits_v)
            dst_v = v_cache_ptr + slot * stride_vc + kh * stride_vch
            tl.store(dst_v + d, encode(v, scale_v, KIND, QMAX, ty_c), mask=d_ok)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def rotary_store(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the stacked queries and keys `qk` [T, H + KVH, D] at `positions` [T] with the table `cos_sin`
    [2, positions, rotary_dim]; write the keys and `v` [T, KVH, D] into the caches [blocks, block_size, KVH,
    D] at `slot_mapping` [T] (quantized, with `kv_scales` [2, blocks, block_size, KVH], if the cache is
    int8 / fp8). Returns the rotated queries [T, H, D]."""
    t, kvh, d = v.shape
    h = qk.shape[1] - kvh
    if qk.stride(-1) != 1 or v.stride(-1) != 1 or not cos_sin.is_contiguous():
        raise ValueError("rotary_store needs rows with unit stride and a contiguous cos/sin table")
    q = torch.empty(t, h, d, dtype=qk.dtype, device=qk.device)
    kind = KV_KINDS.get(k_cache.dtype, KV_FLOAT)
    # the format's largest value, as kv_quant scales to: 127, 448, 57344
    qmax = 1.0 if kind == KV_FLOAT else float((torch.iinfo if kind == KV_INT8 else torch.finfo)(k_cache.dtype).max)
    ks = vs = slot_mapping  # not read for a float cache
    if kind != KV_FLOAT:
        ks, vs = kv_scales[0].view(torch.int16), kv_scales[1].view(torch.int16)
        if kind != KV_INT8:  # fp8 written as the bytes the kernel encodes
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    rotary_store_kernel[(t, h + kvh)](
        qk, v, positions, cos_sin, slot_mapping, q, k_cache, v_cache, ks, vs,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), q.stride(0), q.stride(1), cos_sin.stride(0),
        cos_sin.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), kvh,
        H=h, D=d, ROT=rotary_dim, INTERLEAVED=interleaved, KIND=kind, QMAX=qmax, BLOCK_D=_p2(d), BLOCK_HALF=_p2(rotary_dim // 2),
    )  # fmt: skip
    return q
