"""Paged attention in Triton: every query token of a step (decodes and prompt chunks alike) attends its
request's cached and new keys read straight from the blocks through the block table; no gather copy, no
padding to the longest context, no mask tensor.

One program takes a tile of `BLOCK_M` query tokens of one request and one kv head, with all `GROUP`
query heads that share it as rows of the same tile (so K and V are loaded once per group, not once per
head: GQA / MQA / absorbed MLA), and walks the keys `BLOCK_N` at a time with an online softmax. The causal
limit, a sliding window and the context length are positions computed in the kernel. Long contexts with
few query tiles are split over the key length (`num_splits` programs per tile, each a slice; a second
kernel merges their partial maxima, sums and outputs), so a batch-1 decode still fills the GPU.

Scores may be soft-capped (cap * tanh(s / cap)); a sink is each head's extra logit with no value (it
starts the online softmax as a key whose value is zero). An int8 / fp8 cache is read as bytes with its
bfloat16 scale per token and kv head (`attention/kv_quant.py`) and dequantized in registers. A latent
(MLA) cache passes the same tensor as keys and, through a narrower view, values. fp8 bytes and bfloat16
scales are decoded from their bits, which also runs in Triton's interpreter (TRITON_INTERPRET=1), where
the tests run it on CPU against the torch backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FLOAT, KV_INT8, KV_E4M3, KV_E5M2 = 0, 1, 2, 3
KV_KINDS = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}


@triton.jit
def load_kv(ptr, scale_ptr, rows_off, scale_off, mask, key_ok, KIND: tl.constexpr):
    """A [BLOCK_N, D] tile of keys or values in float32 (quantized ones times their row's scale)."""
    raw = tl.load(ptr + rows_off, mask=mask, other=0)
    if KIND <= 1:  # a float cache, or int8
        x = raw.to(tl.float32)
    elif KIND == 2:  # e4m3fn: normal = bits rebiased by 120 into a float32; subnormal = mantissa * 2^-9
        b = raw.to(tl.int32) & 0xFF
        m = b & 0x7F
        magnitude = tl.where(
            m > 7, ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125
        )
        x = tl.where(b >= 128, -magnitude, magnitude)
    else:  # e5m2: the high byte of a float16
        x = ((raw.to(tl.int32) & 0xFF) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if KIND != 0:  # times the row's bfloat16 scale: the high half of a float32
        s = tl.load(scale_ptr + scale_off, mask=key_ok, other=0).to(tl.int32) & 0xFFFF
        x = x * (s << 16).to(tl.float32, bitcast=True)[:, None]
    return x


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, sinks_ptr, table_ptr, qsl_ptr, seq_lens_ptr, tile_req_ptr, tile_start_ptr,
    out_ptr, part_ptr, part_ml_ptr,
    scale, soft_cap, window, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_table, stride_ot, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BS: tl.constexpr, KV_KIND: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
    SINKS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    tile, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(qsl_ptr + req)
    num_new = tl.load(qsl_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, R)  # BLOCK_M x GROUP_P2 rows, padded to 16 for tensor cores
    tok = m0 + rows // GROUP_P2  # the query token of each row (within the request)
    head = kvh * GROUP + rows % GROUP_P2
    row_ok = (tok < num_new) & (rows % GROUP_P2 < GROUP) & (rows < BLOCK_M * GROUP_P2)
    q_pos = seq_len - num_new + tok  # its position: the keys up to it are visible
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_off = (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)

    # this tile's keys: [lo, hi), cut into num_splits slices of whole BLOCK_N
    hi = tl.minimum(seq_len, seq_len - num_new + m0 + BLOCK_M)
    lo = 0
    if WINDOW:
        lo = tl.maximum(seq_len - num_new + m0 - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    stop = tl.minimum(hi, start + chunk)

    m_i = tl.full((R,), float("-inf"), tl.float32)
    l_i = tl.zeros((R,), tl.float32)
    if SINKS:  # the first slice starts with the sink: a key of logit `sink` whose value is zero
        first = row_ok & (rows * 0 + split == 0)
        m_i = tl.load(sinks_ptr + head, mask=first, other=float("-inf")).to(tl.float32)
        l_i = tl.where(first, 1.0, 0.0)
    acc = tl.zeros((R, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < stop
        block = tl.load(table_ptr + req * stride_table + keys // BS, mask=key_ok, other=0).to(tl.int64)
        slot_k = block * stride_kb + (keys % BS) * stride_ks + kvh * stride_kh
        slot_v = block * stride_vb + (keys % BS) * stride_vs + kvh * stride_vh
        slot_s = block * stride_sb + (keys % BS) * stride_ss + kvh
        kmask = key_ok[:, None] & (d[None, :] < D)
        k = load_kv(k_ptr, ks_ptr, slot_k[:, None] + d[None, :], slot_s, kmask, key_ok, KV_KIND)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32)
        s = s * scale
        if SOFT_CAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vmask = key_ok[:, None] & (dv[None, :] < DV)
        v = load_kv(v_ptr, vs_ptr, slot_v[:, None] + dv[None, :], slot_s, vmask, key_ok, KV_KIND)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype)).to(tl.float32)
        m_i = m_new

    t = q_begin + tok
    if SPLIT:  # partial results, merged by `merge_splits`: [T, H, splits, DV], max and sum [T, H, splits, 2]
        part = (t * H + head) * num_splits + split
        tl.store(part_ptr + part[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv[None, :] < DV))
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = t[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def merge_splits(
    part_ptr, part_ml_ptr, out_ptr, num_splits, stride_ot, stride_oh,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    base = (t * H + h) * num_splits + s
    m = tl.load(part_ml_ptr + base * 2, mask=s < num_splits, other=float("-inf"))
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=s < num_splits, other=0.0)  # noqa: E741
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(
        part_ptr + base[:, None] * DV + dv[None, :], mask=(s[:, None] < num_splits) & (dv[None, :] < DV), other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def query_tiles(query_start_loc: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(request, first token within it) of every tile of `block_m` query tokens: the kernel's first grid axis."""
    reqs, starts = [], []
    for r in range(len(query_start_loc) - 1):
        for m0 in range(0, query_start_loc[r + 1] - query_start_loc[r], block_m):
            reqs.append(r)
            starts.append(m0)
    return reqs, starts


def block_m_for(max_new: int) -> int:
    """Query tokens per tile: one for a step of decodes, else up to 16 (times the kv group's query heads
    are a tile's rows)."""
    return min(16, _p2(max_new))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_req: torch.Tensor,
    tile_start: torch.Tensor,
    block_m: int,
    scale: float,
    *,
    num_splits: int = 1,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 16,
) -> torch.Tensor:
    """q [T, H, D] (each request's new tokens after its cached ones, `query_start_loc` [B + 1]; `seq_lens`
    [B] cached + new) over the caches [blocks, block_size, KVH, D] / [.., DV] (the value cache may be a
    view of the key cache: MLA) through `block_table` [B, blocks] -> [T, H, DV]. `tile_req` / `tile_start`:
    `query_tiles(.., block_m)` on the device. `kv_scales` [2, blocks, block_size, KVH]: an int8 / fp8
    cache's bfloat16 scales. `out` may be given (every row is written)."""
    t, h, d = q.shape
    nb, bs, kvh, dv = v_cache.shape
    group = h // kvh
    if out is None:
        out = torch.empty(t, h, dv, dtype=q.dtype, device=q.device)
    kind = KV_KINDS.get(k_cache.dtype, KV_FLOAT)
    if kind != KV_FLOAT:
        if kv_scales is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs its scales")
        if kind != KV_INT8:  # fp8 read as bytes and decoded in the kernel
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        ks, vs = kv_scales[0].view(torch.int16), kv_scales[1].view(torch.int16)
        if ks.stride(-1) != 1 or ks.stride(1) != kvh:
            raise ValueError("KV scales must be [blocks, block_size, kv_heads] contiguous")
    else:
        ks = vs = block_table  # not read
    split = num_splits > 1
    part = part_ml = out
    if split:
        part = torch.empty(t, h, num_splits, dv, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, h, num_splits, 2, dtype=torch.float32, device=q.device)
    grid = (tile_req.numel(), kvh, num_splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, ks, vs, sinks if sinks is not None else q, block_table, query_start_loc, seq_lens,
        tile_req, tile_start, out, part, part_ml,
        scale, soft_cap or 0.0, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), ks.stride(0), ks.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        H=h, GROUP=group, GROUP_P2=_p2(group), D=d, DV=dv, BLOCK_D=max(16, _p2(d)), BLOCK_DV=max(16, _p2(dv)), BLOCK_M=block_m,
        BLOCK_N=block_n, BS=bs, KV_KIND=kind, SOFT_CAP=soft_cap is not None, WINDOW=sliding_window is not None,
        SINKS=sinks is not None, SPLIT=split, IEEE=q.dtype == torch.float32, R=max(16, block_m * _p2(group)),
    )  # fmt: skip
    if split:
        merge_splits[(t, h)](
            part, part_ml, out, num_splits, out.stride(0), out.stride(1),
            H=h, DV=dv, BLOCK_DV=max(16, _p2(dv)), BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kc, stride_vc, stride_kch, stride_vch,
    HAS_V: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot: a padding row (a CUDA graph's batch), written nowhere
        d = tl.arange(0, BLOCK_D)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=d < D)
        tl.store(k_cache_ptr + slot * stride_kc + h * stride_kch + d, k.to(k_cache_ptr.dtype.element_ty), mask=d < D)
        if HAS_V:
            dv = tl.arange(0, BLOCK_DV)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=dv < DV)
            tl.store(
                v_cache_ptr + slot * stride_vc + h * stride_vch + dv, v.to(v_cache_ptr.dtype.element_ty), mask=dv < DV
            )


def write_kv(
    k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k [T, KVH, D] (and v [T, KVH, DV]; None for a latent cache: keys only) into the float caches
    [blocks, block_size, KVH, D] at `slot_mapping` [T]; rows with a negative slot are skipped."""
    t, kvh, d = k.shape
    dv = d if v is None else v.shape[-1]
    v_arg = k if v is None else v
    write_kv_kernel[(t, kvh)](
        k, v_arg, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), k_cache.stride(1), v_cache.stride(1),
        k_cache.stride(2), v_cache.stride(2),
        HAS_V=v is not None, D=d, DV=dv, BLOCK_D=_p2(d), BLOCK_DV=_p2(dv),
    )  # fmt: skip
