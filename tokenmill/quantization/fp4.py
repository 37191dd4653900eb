"""`mxfp4` and `nvfp4`: a dense checkpoint's linear weights quantized on load to FP4 (e2m1: the values
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times a scale per block of input columns:

- MXFP4 (OCP Microscaling): blocks of 32, an E8M0 scale (a power of two) per block,
  2^(floor(log2(absmax)) - 2) as the spec chooses it (values past 6 saturate to 6).
- NVFP4: blocks of 16, a float8 e4m3 scale per block times a float32 scale per tensor (per
  checkpoint tensor of a fused layer): global = absmax / (448 * 6), block = e4m3(absmax_block / 6 /
  global).
Values round to the nearest e2m1 value (ties to even, as the specs say).

Twice an e2m1 value is an integer (0, +-1, 2, 3, 4, 6, 8, 12), so an FP4 weight is exactly an integer
code times (block scale / 2). On CPU the block kernels (`tokenmill.kernels.block_quant`) keep the
format's own nibbles and decode them through a 16-entry table to those codes plus 12 (pshufb), then
multiply as they do other codes with a center: MXFP4 in 4.25 bits a weight (its power-of-two scales as E8M0
bytes), NVFP4 in 4.5 (its e4m3 scales as bytes, and the tensor's float32 scale, halved, once per row:
the kernels multiply the two as they expand a row's scales, the one rounding of NVFP4's own
dequantization). The Triton kernel on other devices reads the same nibbles and scales. Activations as for int8/int4:
rounded to int8 per 32 values by default, float32 with an explicit `--dtype float32`. The LM head keeps 8 bits per channel (int8, as under int4). Input columns must
be whole blocks of 32 (the block kernels' unit, for either format).
The routed experts of MoE models are quantized the same way (`expert_method`), each expert's
projections held as block-quantized modules (`layers.fused_moe.ExpertProjection`).
Checkpoints already in MXFP4 / NVFP4 are read from compressed-tensors' layouts
(`compressed_tensors.py`, through `unpack_e2m1`) and from GPT-OSS's (`quant_method: mxfp4`, its
experts' `*_blocks` and E8M0 `*_scales`: `e8m0_codes`; the model file hands them over as `Codes`,
and its other layers are dense in the checkpoint and stay so).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels.block_quant import E2M1_CODES
from tokenmill.quantization.base import LinearMethod, QuantizationConfig, dense
from tokenmill.quantization.gguf import BlockLayout, BlockQuantLinearMethod
from tokenmill.quantization.gguf_codes import Codes
from tokenmill.quantization.int_quant import QuantizeOnLoadMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
BLOCKS = {"mxfp4": 32, "nvfp4": 16}
# the formats' nibbles in each one's block size (MXFP4's scales as E8M0 bytes)
LAYOUTS = {
    "mxfp4": BlockLayout(E2M1_CODES, 32, False, 12, e8m0=True),
    "nvfp4": BlockLayout(E2M1_CODES, 16, False, 12, e4m3=True),
}
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def round_e2m1(u: torch.Tensor) -> torch.Tensor:
    """`u` (float32) rounded to the nearest e2m1 value, ties to the even one (grid index even), past
    6 saturated: returned as the integer codes 2 * e2m1 (int16), signed."""
    a = u.abs()
    idx = torch.bucketize(a, _MIDPOINTS)  # a tie falls to the lower neighbour
    tie = a == _MIDPOINTS[idx.clamp(max=len(_MIDPOINTS) - 1)]
    idx = idx + (tie & (idx % 2 == 1)).long()  # ...unless that one is odd
    codes = (2 * E2M1[idx]).to(torch.int16)
    return torch.where(u < 0, -codes, codes)


def unpack_e2m1(packed: torch.Tensor) -> np.ndarray:
    """uint8 [rows, cols / 2], two e2m1 values a byte (the first in the low nibble; bit 3 the sign,
    bits 0-2 the index into the magnitudes) -> their codes 2 * value, int16 [rows, cols]."""
    b = packed.numpy()
    nibbles = np.stack((b & 0x0F, b >> 4), axis=-1).reshape(b.shape[0], -1)
    magnitudes = (2 * E2M1).to(torch.int16).numpy()[nibbles & 7]
    return np.where(nibbles & 8, -magnitudes, magnitudes)


def block_scales(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale of every block of `w` [N, K / block, block] as (block factors [N, K / block], tensor
    factor []) float32, whose product (one rounding) each e2m1 value multiplies: MXFP4 a power of two
    and 1; NVFP4 an e4m3 value and the tensor's float32 scale."""
    amax = w.abs().amax(-1)
    if method == "mxfp4":
        _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
        e = torch.where(amax > 0, exponent - 1 - 2, torch.zeros_like(exponent)).clamp(-125, 127)
        return torch.ldexp(torch.ones_like(amax), e), torch.tensor(1.0)
    tensor_amax = float(amax.max()) if amax.numel() else 0.0
    glob = torch.tensor(tensor_amax / (E4M3_MAX * E2M1_MAX) if tensor_amax > 0 else 1.0, dtype=torch.float32)
    return (amax / E2M1_MAX / glob).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float(), glob


def fp4_codes(q: np.ndarray, block_scales: np.ndarray, method: str, tensor_scale: float = 1.0) -> Codes:
    """Codes 2 * e2m1 [N, K] with the scale each e2m1 value multiplies per block (times `tensor_scale`,
    NVFP4's), as `Codes` in `method`'s layout (the scales halved; NVFP4's e4m3 ones as they are, the
    tensor's halved as every row's factor)."""
    layout = LAYOUTS[method]
    scales = block_scales.astype(np.float32)
    if layout.e4m3:
        return Codes(
            q,
            scales,
            None,
            BLOCKS[method],
            layout.bits,
            layout.center,
            row_scales=np.full(q.shape[0], np.float32(tensor_scale) / 2, dtype=np.float32),
        )
    return Codes(q, scales * np.float32(tensor_scale / 2), None, BLOCKS[method], layout.bits, layout.center)


def e8m0_codes(blocks: torch.Tensor, scales: torch.Tensor) -> Codes:
    """An MXFP4 tensor as GPT-OSS stores it: `blocks` uint8 [N, K / 32, 16] (two e2m1 values a byte,
    the first in the low nibble), `scales` uint8 [N, K / 32] (E8M0: the block scale is
    2^(byte - 127)) -> its `Codes` in the MXFP4 layout."""
    rows = blocks.shape[0]
    q = unpack_e2m1(blocks.reshape(rows, -1))
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)
    return fp4_codes(q, scale.numpy(), "mxfp4")


def quantize(weight: torch.Tensor, method: str) -> Codes:
    """`weight` [N, K] in `method`'s FP4 as `Codes`: q = 2 * e2m1 value times half its block scale."""
    block = BLOCKS[method]
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, cols // block, block)
    factors, glob = block_scales(w, method)
    scale = factors * glob
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, round_e2m1(w / safe[..., None]), torch.zeros_like(w, dtype=torch.int16))
    return fp4_codes(q.reshape(rows, cols).numpy(), factors.numpy(), method, float(glob))


class FP4LinearMethod(BlockQuantLinearMethod):
    def __init__(self, method: str, int8_activations: bool) -> None:
        super().__init__(LAYOUTS[method], int8_activations, half=False)
        self.method = method

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if input_size % 32:
            raise ValueError(
                f"{layer.prefix}: --quantization {self.method} needs input columns in whole blocks of 32 "
                f"(the block kernels' unit); this layer has {input_size}"
            )
        super().create_weights(layer, input_size, output_sizes, params_dtype)

    def load(self, layer, weight, rows, src_rows, src_cols):
        """A dense tensor is quantized; a checkpoint's own FP4 `Codes` are written as they are."""
        if isinstance(weight, Codes):
            self.write(layer, weight.columns(src_cols) if src_cols != slice(None) else weight, rows, src_rows)
        else:
            self.write(layer, quantize(dense(weight)[src_rows, src_cols], self.method), rows)


class FP4Config(QuantizationConfig):
    """`experts_only`: a checkpoint that ships only its experts in FP4 (GPT-OSS): its linear layers
    are dense in the checkpoint and stay dense."""

    def __init__(self, method: str, int8_activations: bool, experts_only: bool = False) -> None:
        super().__init__()
        if method not in BLOCKS:
            raise ValueError(f"FP4 methods are {', '.join(BLOCKS)}; got {method!r}")
        self.name, self.int8_activations = method, int8_activations
        self.experts_only = experts_only

    def expert_method(self, prefix: str) -> LinearMethod:
        return FP4LinearMethod(self.name, self.int8_activations)

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.experts_only:
            return UnquantizedLinearMethod()
        if prefix.endswith("lm_head"):
            return QuantizeOnLoadMethod(8, None, True, self.int8_activations)
        return FP4LinearMethod(self.name, self.int8_activations)
