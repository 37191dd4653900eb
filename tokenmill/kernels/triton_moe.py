"""Grouped GEMM for MoE experts in Triton: every expert's rows through its own weight in one launch.

The rows come sorted by expert (`layers/fused_moe.grouped_experts`), `counts[e]` of them for expert e.
Each expert's run of rows is cut into tiles of BLOCK_M rows that never cross into the next expert (its
last tile is partly masked), so a program reads one expert's weight tile; which expert a tile belongs to
is worked out on the device from the counts (the grid is sized for the most tiles any split can need:
rows / BLOCK_M + experts), so nothing waits for the host — unlike a loop over the experts that reads the
counts back to slice the rows. Dense stacked weights [E, N, K] in the compute dtype, or block-quantized
experts' blocks stacked (`triton_block.grouped_matmul`: the same tiles, the weights decoded in the K
loop); accumulation in float32 (IEEE products for float32 inputs). Tested on CPU under
TRITON_INTERPRET=1; FusedMoE uses it on CUDA for dense and block-quantized experts.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.kernels import block_quant, triton_block

BLOCK_M, BLOCK_N, BLOCK_K = triton_block.GROUPED_BM, 64, 32  # one tile map for dense and quantized experts


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm(
        x_ptr, w_ptr, out_ptr, counts_ptr, starts_ptr, tile_starts_ptr, tile_expert_ptr, N, K, E,
        stride_x, stride_we, stride_wn, stride_o, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        e = tl.load(tile_expert_ptr + tile)
        if e < E:
            local = (tile - tl.load(tile_starts_ptr + e)) * BM + tl.arange(0, BM)  # rows within expert e
            row_ok = local < tl.load(counts_ptr + e)
            rows = (tl.load(starts_ptr + e) + local).to(tl.int64)
            rn = tl.program_id(1) * BN + tl.arange(0, BN)
            acc = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                x = tl.load(
                    x_ptr + rows[:, None] * stride_x + rk[None, :], mask=row_ok[:, None] & (rk[None, :] < K), other=0.0
                )
                w = tl.load(
                    w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0,
                )
                if IEEE:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
            tl.store(
                out_ptr + rows[:, None] * stride_o + rn[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & (rn[None, :] < N),
            )

    return grouped_gemm


def tile_map(counts: torch.Tensor, num_rows: int, block_m: int = BLOCK_M):
    """On the device, from `counts` [E]: each expert's first row and first tile, and the expert of each
    of the rows / block_m + E tiles (E: a tile past the last expert's)."""
    num_experts = counts.numel()
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    max_tiles = -(-num_rows // block_m) + num_experts
    tile_expert = torch.searchsorted(tile_ends, torch.arange(max_tiles, device=counts.device), right=True)
    return torch.cumsum(counts, 0) - counts, tile_ends - tiles, tile_expert, max_tiles


def grouped_matmul(x: torch.Tensor, weights, counts: torch.Tensor, maps=None) -> torch.Tensor:
    """x [R, K] (rows grouped by expert, counts[e] rows for expert e) -> [R, N]: each row times its expert's
    weights[e] [N, K] transposed. `weights`: dense [E, N, K], or every expert's blocks stacked (a
    `block_quant.Blocks` of [E, ...] tensors: `triton_block.grouped_matmul`). `maps`: `tile_map(counts,
    R)`, to share between the two projections."""
    import triton

    r, k = x.shape
    maps = maps or tile_map(counts, r)
    if isinstance(weights, block_quant.Blocks):
        return triton_block.grouped_matmul(x, weights, counts, maps)
    n = weights.shape[1]
    starts, tile_starts, tile_expert, max_tiles = maps
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _kernel()[(max_tiles, triton.cdiv(n, BLOCK_N))](
        x, weights, out, counts, starts, tile_starts, tile_expert, n, k, counts.numel(),
        x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return out


def run_experts(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w13,
    w2,
    activation,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`FusedMoE.run_experts` for stacked experts (dense, or their blocks): gate_up, activation, down, two
    launches."""
    maps = tile_map(counts, rows.shape[0])
    expert_of_row = None
    if w13_bias is not None or w2_bias is not None:
        experts = torch.arange(counts.numel(), device=rows.device)
        expert_of_row = torch.repeat_interleave(experts, counts, output_size=rows.shape[0])
    gate_up = grouped_matmul(rows, w13, counts, maps)
    if w13_bias is not None:
        gate_up += w13_bias[expert_of_row]
    out = grouped_matmul(activation(gate_up), w2, counts, maps)
    if w2_bias is not None:
        out += w2_bias[expert_of_row]
    return out
