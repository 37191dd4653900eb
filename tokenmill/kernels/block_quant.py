"""Matmul on block-quantized weights, on CPU: w = scale * (code - center) + offset per block of 16
or 32 values, the layout `tokenmill.quantization.gguf` builds from a GGUF file's own blocks (Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K) in about as many bits as the file holds
them. The weights are dequantized inside the matmul, so a decode step reads ~5-6x fewer weight bytes
than float32 while computing on the very float32 weights that `gguf.dequantize` gives: every scale
and offset is a float16 value (or, for K-quants, a small integer times its super-block's float16
scale or min), and those products, times a code, are exact in float32 (an 11-bit mantissa times an 8-bit sub-scale
times a code of at most 8 bits fits 24 bits); the kernels are built with -ffp-contract=off so nothing
else is fused.

Layout (`Blocks`), per weight row of K values:
  codes  4, 5, 6 bits: uint8 [N, K/2], the low four bits: in each 16-byte group byte j holds value
         j (low nibble) and value j+16 (high nibble), as in GGUF; 8 bits: int8 [N, K], signed.
  high   5 bits: uint8 [N, K/8], 4 bytes a 32-value group, bit j the fifth bit of value j;
         6 bits: uint8 [N, K/4], 8 bytes a group, byte k bits 2i..2i+1 the top bits of value 8i+k.
  scales float16 [N, K/block]; offsets float16 [N, K/block] or none; or both int8 (a K-quant's
         sub-block scales and mins are 6- or 8-bit integers: a byte each, as the file keeps them);
  supers float16 [N, K/256, 2] or none: (scale, min) of each 256 values, multiplying scales, offsets.
         (Or scales and offsets in float32, the products already taken, and no supers: the exact
         mode's choice, whose float kernel then reads them in place: speed over bytes.)
  center the codes' zero (Q4_0: 8, Q5_0: 16, Q6_K: 32), 0 for 8-bit codes.
  bits   4, 5, 6 or 8; or E2M1_CODES (-4): FP4 e2m1 nibbles (bit 3 the sign, bits 0-2 the index
         into 0, 0.5, 1, 1.5, 2, 3, 4, 6) laid out as 4-bit codes, each decoded through a table to
         12 + 2 * value (0..24), center 12: unsigned codes like the others (MXFP4 and NVFP4 in 4
         bits a weight).
  scales also uint8 E8M0 (MXFP4's power-of-two block scales: the scale is 2^(byte - 128), half the
         block scale, as the codes are twice the e2m1 values), or float8_e4m3fn (NVFP4's block scales)
         with `supers` float32 [N, 1], the factor of every scale in its row (NVFP4's tensor scale, halved);
         both expanded exactly to float32 (an e4m3 value times the factor: one rounding, as NVFP4's
         own dequantization).
`matmul` handles few rows of activations (decode) by dequantizing each weight row in registers;
`matmul_q8` (int8 activations: a scale per 32 values, per 256 for K-quants) takes one row as a
memory-bound pass (K-quants summed in integers to the end of each super-block) and more as register tiles of 8 rows against each weight row (fast
at every batch size for 4-5-bit codes); `matmul_q8_panels` does the same for several rows on a 4-, 5- or 8-bit
weight, or a Q6_K one, repacked once at load (`repack_panels`: eight weight rows interleaved per 4 values, so
that one broadcast activation word feeds eight rows' dot products); `dequantize` writes the
float32 weight for large batches, which then go to torch's GEMM. The C++ is csrc/block_quant.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import cpu_kernels, host_memory

BLOCK = 32
E2M1_CODES = -4  # `Blocks.bits` of FP4 e2m1 nibbles, decoded through a table (module docstring)


def load():
    """The compiled extension (`tokenmill.kernels.cpu_kernels`), or None when there is none here."""
    return cpu_kernels()


@dataclass(frozen=True)
class Blocks:
    """A packed weight as the kernels take it (the layout in the module docstring)."""

    codes: torch.Tensor
    high: torch.Tensor | None
    scales: torch.Tensor
    offsets: torch.Tensor | None
    supers: torch.Tensor | None
    bits: int
    center: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (1 if self.bits == 8 else 2)

    @property
    def block(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def args(self) -> tuple:
        return (self.codes, self.high, self.scales, self.offsets, self.supers, self.bits, self.block, self.center)

    @property
    def activation_span(self) -> int:
        """How many activation values `matmul_q8` rounds with one scale: a K-quant super-block (256) when
        the sub-block scales are int8 beside float16 supers (llama.cpp's q8_K), else a 32-value group."""
        return 256 if self.supers is not None and self.scales.dtype == torch.int8 else BLOCK


def matmul(x: torch.Tensor, w: Blocks) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ dequantized weight [N, K].T -> [M, N]."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    load().block_quant_matmul(x, *w.args(), out)
    return out


def round_activations(x: torch.Tensor, span: int = BLOCK) -> torch.Tensor:
    """x [M, K] rounded as `matmul_q8` rounds it: to int8 codes per `span` values (`Blocks.activation_span`),
    scale max|x| / 127 (half to even), returned as floats."""
    blocks = x.view(x.shape[0], -1, span)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).view(x.shape)


def matmul_q8(x: torch.Tensor, w: Blocks) -> torch.Tensor:
    """`matmul` of `round_activations(x)` with integer dot products (close to `matmul`, not exact)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    load().block_quant_matmul_q8(x, *w.args(), out)
    return out


PANEL_BITS = (4, 5, 8)  # the codes panels hold in blocks of 32 (and Q6_K's: `is_q6_k`)
PANEL_BLOCK_BYTES = {4: 128, 5: 160, 6: 256, 8: 256}  # a panel's codes per block of 32 values, by bits
Q6_K_PANEL_BYTES = 144  # per panel and super-block: 16 sub-block scales of 8 rows, 8 float16 super-block scales


@dataclass(frozen=True)
class Panels:
    """A weight repacked for `matmul_q8_panels` (csrc/block_quant.cpp's panel layout): codes uint8
    [ceil(N / 8), K / 32, PANEL_BLOCK_BYTES[bits]], eight rows' values interleaved per 4 (4 and 5 bits as
    nibbles, 5 bits' fifth bits in a plane after them: a one-row step reads 5 bits a weight, not 8);
    scales float32 [.., K / 32, 2, 8], each block's scales and offsets (the codes' center folded in)
    of the eight rows, exactly as the blocks hold them, or [.., K / 32, 1, 8], the scales alone, where
    the blocks have no offsets and the codes are signed or centered on half their range (Q8_0, Q4_0,
    Q5_0: the kernel takes the center back from the activations' integer sums: fewer bytes a step and
    no float op a block for it); float16 where every one of them is a float16 value (the GGUF types
    whose scales are float16: Q4_0/1, Q5_0/1, Q8_0): a one-row step reads the whole weight per token,
    and a 4-bit one is then a sixth smaller. Q6_K
    (bits 6): scales uint8 [.., K / 256, Q6_K_PANEL_BYTES], the file's own integers (int8 scales per 16
    values, float16 super-block scales) of the eight rows, which the kernel applies to integer sums."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    rows: int  # N
    activation_span: int  # Blocks.activation_span of the weight it was packed from


def is_q6_k(w: Blocks) -> bool:
    """Whether `w` holds Q6_K's blocks as the file does: 6-bit codes centered on 32 in blocks of 16, int8
    sub-block scales under float16 super-block scales, no offsets."""
    return (
        (w.bits, w.block, w.center) == (6, 16, 32)
        and w.scales.dtype == torch.int8
        and w.supers is not None
        and w.offsets is None
    )


def _centered(w: Blocks) -> bool:
    """Whether `w`'s panels need no offsets: none stored, and codes signed (8 bits) or centered on half
    their range (4-5 bits), a center the kernel repays in integers."""
    return w.offsets is None and w.center == (0 if w.bits == 8 else 1 << (w.bits - 1))


def repack_panels(w: Blocks) -> Panels | None:
    """`w` as panels, or None where they do not apply (codes of other bits or blocks of 16 but Q6_K's,
    weights off the CPU, or no compiled kernels here)."""
    paneled = (w.bits in PANEL_BITS and w.block == BLOCK) or is_q6_k(w)
    if not paneled or w.codes.device.type != "cpu" or load() is None:
        return None
    n, k = w.shape
    panels = -(-n // 8)
    # on huge pages: a one-row step streams every panel from memory (host_memory)
    codes = host_memory.zeros((panels, k // BLOCK, PANEL_BLOCK_BYTES[w.bits]), torch.uint8)
    if w.bits == 6:
        scales = host_memory.zeros((panels, k // 256, Q6_K_PANEL_BYTES), torch.uint8)
        load().block_quant_repack_panels(*w.args(), codes, scales)
        return Panels(codes, scales, w.bits, n, w.activation_span)
    scales = torch.zeros(panels, k // BLOCK, 1 if _centered(w) else 2, 8, dtype=torch.float32)
    load().block_quant_repack_panels(*w.args(), codes, scales)
    half = scales.half()
    kept = half if torch.equal(half.float(), scales) else scales
    return Panels(codes, host_memory.copy(kept), w.bits, n, w.activation_span)


def int8_peak(iterations: int) -> int:
    """Every torch thread at once, `iterations` passes of 12 independent sums on the tiles' int8 instruction
    (vpdpbusd, or AVX2's maddubs): the multiply-adds done, for timing this machine's int8 peak."""
    return load().block_quant_int8_peak(iterations)


def matmul_q8_panels(x: torch.Tensor, w: Panels) -> torch.Tensor:
    """`matmul_q8` on the repacked weight: the same integer sums, the float ones in another order."""
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32)
    load().block_quant_matmul_q8_panels(x, w.codes, w.scales, w.bits, w.activation_span, out)
    return out


_workspace = torch.empty(0)


def workspace(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] scratch buffer shared by all layers (one dequantized weight at a time)."""
    global _workspace
    if _workspace.numel() < rows * cols:
        _workspace = torch.empty(rows * cols)
    return _workspace[: rows * cols].view(rows, cols)


def dequantize(w: Blocks, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] (into `out` when given)."""
    if out is None:
        out = torch.empty(*w.shape, dtype=torch.float32)
    load().block_quant_dequantize(*w.args(), out)
    return out
