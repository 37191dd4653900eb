"""`gguf` (the exact mode for GGUF files on CPU) and `gguf-q8` (the default): linear layers keep the
file's quantized weights packed — Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K —
and the matmul dequantizes inside the kernel (`tokenmill.kernels.block_quant`), so the model computes
on the same float32 weights as the dequantized checkpoint while a decode step reads 5-6x fewer bytes.

Every type becomes w = scale * (code - center) + offset per block (`BlockLayout`, stored as
`block_quant.Blocks`): codes of 4, 5 or 6 bits (a nibble plane plus a plane of the top bits) or 8,
float16 scales and offsets per block of 32 (Q6_K: 16) — for K-quants the sub-block integers as int8
and the super-block's float16 scale and min beside them — about as many bits as the file's own
blocks, every value exact.
A fused layer whose shards come in different types takes the widest layout among them (more code
bits, the smaller block, an offset where the shards' centers differ), again exactly.
Other types (Q2_K, Q3_K, floats) stay dense: dequantized at load.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.distributed import expert_parallel, parallel_state
from tokenmill.kernels import block_quant, cpu_flags, triton_block
from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.gguf_codes import SUPER, Codes
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

# batches up to this many tokens run the fused kernel; larger ones dequantize once and use torch's GEMM
FUSED_MAX_TOKENS = 16


def fused_max_tokens(bits: int, int8_activations: bool) -> int | None:
    """The most tokens a step runs through the fused kernel (None: any number). Measured
    (`benchmarks/bench_block_kernels.py --rows`): the integer kernel's register tiles beat dequantizing
    + float32 GEMM at every batch size for 4-5-bit codes and up to a few hundred tokens for 6-8-bit
    ones — on two Zen 3 cores (AVX2; ~105 vs 70-80 G MAC/s) and on two AVX-512 Zen 4 cores (Q4_K 86
    vs 50 G MAC/s at 256 rows, Q6_K 58 vs 48, Q8_0 60 vs 53). The float kernel keeps the step size
    the fused kernels were first tuned for."""
    if not int8_activations:
        return FUSED_MAX_TOKENS
    if bfloat16_gemm():
        return BF16_MIN_TOKENS
    return None if bits <= 5 else 128


# with AMX, steps past this many tokens dequantize to bfloat16 for torch's GEMM (int8 tiles below it)
BF16_MIN_TOKENS = 128


def bfloat16_gemm() -> bool:
    """Whether large fast-mode steps run a bfloat16 GEMM on the dequantized weight: on CPUs with AMX
    tiles for bfloat16, where torch's (oneDNN's) bf16 GEMM runs ~1,000 G MAC/s on two Sapphire Rapids
    cores against the int8 tiles' ~110 (`benchmarks/bench_block_kernels.py`); past 128 tokens that
    pays for dequantizing and converting the weight (~23 ms for 17920 x 1536) several times over.
    $TOKENMILL_BF16_GEMM=0 turns it off."""
    return os.environ.get("TOKENMILL_BF16_GEMM", "1") != "0" and {"amx_bf16", "amx_tile"} <= cpu_flags()


@dataclass(frozen=True)
class BlockLayout:
    bits: int  # 4, 5, 6 or 8 per code; or block_quant.E2M1_CODES (FP4 nibbles through a table)
    block: int  # values per scale: 32, or 16
    offsets: bool
    center: int = 0  # the codes' zero (8-bit codes are signed: 0)
    supers: bool = False  # K-quant super-block scales
    e8m0: bool = False  # scales stored as E8M0 bytes (powers of two: MXFP4)
    e4m3: bool = False  # scales stored as e4m3 bytes times a float32 factor per row (NVFP4)

    def widest(self, other: BlockLayout) -> BlockLayout:
        bits = max(self.bits, other.bits)
        same = self.center == other.center or bits == 8
        return BlockLayout(
            bits,
            min(self.block, other.block),
            self.offsets or other.offsets or not same,
            self.center if same and bits < 8 else 0,
            self.supers or other.supers,
        )


# each packed GGUF type's own layout
LAYOUTS = {
    "Q4_0": BlockLayout(4, 32, False, 8),
    "Q4_1": BlockLayout(4, 32, True),
    "Q8_0": BlockLayout(8, 32, False),
    "Q5_0": BlockLayout(5, 32, False, 16),
    "Q5_1": BlockLayout(5, 32, True),
    "Q4_K": BlockLayout(4, 32, True, supers=True),
    "Q5_K": BlockLayout(5, 32, True, supers=True),
    "Q6_K": BlockLayout(6, 16, False, 32, supers=True),
}


# twice the e2m1 values by nibble, and the nibble of each code -12..12 (a code that is none: nibble 0)
_E2M1_VALUE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)
_E2M1_NIBBLE = np.zeros(25, dtype=np.uint8)
for _nibble in range(15, -1, -1):  # 0 keeps nibble 0 (+0)
    _E2M1_NIBBLE[_E2M1_VALUE[_nibble] + 12] = _nibble


def _half(a: np.ndarray) -> np.ndarray:
    h = a.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), a):
        raise ValueError("block scales do not fit float16 exactly")
    return h


def _e8m0(a: np.ndarray) -> np.ndarray:
    """Scales 2^(byte - 128) as their bytes (`block_quant`'s E8M0 storage)."""
    mantissa, exponent = np.frexp(a)
    if not (np.all(mantissa == 0.5) and np.all((exponent >= -127) & (exponent <= 127))):
        raise ValueError("block scales are not powers of two that E8M0 holds")
    return (exponent - 1 + 128).astype(np.uint8)


def _e4m3(a: np.ndarray) -> np.ndarray:
    """Scales that are e4m3 values as those (`block_quant`'s e4m3 storage, viewed as bytes)."""
    b = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.float8_e4m3fn)
    if not torch.equal(b.float(), torch.from_numpy(np.asarray(a, dtype=np.float32))):
        raise ValueError("block scales are not e4m3 values")
    return b.view(torch.uint8).numpy()


def _int8(a: np.ndarray) -> np.ndarray:
    b = a.astype(np.int8)
    if not np.array_equal(b.astype(np.float32), a):
        raise ValueError("block scales are not int8 integers")
    return b


def pack(
    codes: Codes, layout: BlockLayout, half: bool = True, round_half: bool = False, int_scales: bool = False
) -> dict[str, np.ndarray | None]:
    """`codes` in `layout`: the arrays of `block_quant.Blocks` (codes, high, scales, offsets, supers);
    `half` False: float32 scales and offsets with the super-block factors taken, no supers;
    `round_half`: float16 scales and offsets may round (else they must be exact); `int_scales`: int8
    scales and offsets (a K-quant's own sub-block integers, beside its supers; they must fit)."""
    q, scales, offsets, supers = codes.q, codes.scales, codes.offsets, codes.supers
    rows, cols = q.shape
    if layout.e4m3:  # e4m3 scales as they are, their row factors where `supers` go
        if codes.row_scales is None or offsets is not None:
            raise ValueError("e4m3 block scales need their float32 factor per row, and no offsets")
        supers = codes.row_scales.astype(np.float32).reshape(rows, 1)
    elif not half:
        scales, offsets, supers = codes.full_scales(), codes.full_offsets(), None
        layout = dataclasses.replace(layout, supers=False)
    if layout.supers and supers is None:  # a legacy type beside K-quants: super-blocks of one
        supers = np.ones((rows, -(-cols // SUPER), 2), dtype=np.float32)
    if layout.bits < 8 and codes.center != layout.center:  # different centers: the code's center becomes an offset
        if offsets is not None and codes.center:
            raise ValueError("a block type with both a center and offsets")
        if supers is not None and offsets is None:  # the offsets take the scales' super-block factor
            supers = supers.copy()
            supers[..., 1] = supers[..., 0]
        offsets = (offsets if offsets is not None else 0) - codes.center * scales
        q = q + codes.center - layout.center
    if layout.block < codes.block:  # one scale (and offset) per smaller block
        repeat = codes.block // layout.block
        scales = np.repeat(scales, repeat, axis=1)
        offsets = None if offsets is None else np.repeat(offsets, repeat, axis=1)
    if layout.offsets and offsets is None:
        offsets = np.zeros_like(scales)
    if layout.e8m0:
        to = _e8m0
    elif layout.e4m3:
        to = _e4m3
    elif int_scales:
        to = _int8
    else:
        to = (lambda a: a.astype(np.float16 if half else np.float32)) if round_half or not half else _half  # noqa: E731
    out = {
        "codes": None,
        "high": None,
        "scales": to(scales),
        "offsets": None if offsets is None else to(offsets),
        "supers": None if supers is None else supers if layout.e4m3 else _half(supers),
    }
    if layout.bits == 8:
        out["codes"] = q.astype(np.int8)
        return out
    if layout.bits == block_quant.E2M1_CODES:  # nibbles: bit 3 the sign, bits 0-2 the magnitude's index
        u = _E2M1_NIBBLE[q + 12].reshape(rows, -1, 32)
        if not np.array_equal(_E2M1_VALUE[u], q.reshape(u.shape)):
            raise ValueError("codes are not twice e2m1 values")
    else:
        u = (q + layout.center).astype(np.uint8).reshape(rows, -1, 32)
    low = u & 0x0F
    out["codes"] = (low[..., :16] | (low[..., 16:] << 4)).reshape(rows, -1)
    if layout.bits in (5, 6):  # groups 2p, 2p+1 share a record: [pair, L, h, j] for value 16h + j of group 2p + L
        top = np.zeros((rows, -(-u.shape[1] // 2) * 2, 32), dtype=np.uint8)
        top[:, : u.shape[1]] = u >> 4
        top = top.reshape(rows, -1, 2, 2, 16)
        if (
            layout.bits == 5
        ):  # value 16h + j of group L: byte i = 16L + j of vector h, bit 8(i % 8) + i // 8 (+4 for h = 0)
            vec = top.swapaxes(2, 3).reshape(rows, -1, 2, 32)
            i = np.arange(32)
            bits = np.zeros((rows, vec.shape[1], 64), dtype=np.uint8)
            bits[..., 8 * (i % 8) + i // 8 + 4] = vec[:, :, 0]
            bits[..., 8 * (i % 8) + i // 8] = vec[:, :, 1]
            out["high"] = np.packbits(bits, axis=-1, bitorder="little")
        else:  # byte j, bits 2L + 4h
            shifts = (2 * np.arange(2)[:, None] + 4 * np.arange(2)[None, :]).astype(np.uint8)[..., None]
            out["high"] = (top << shifts).sum(axis=(2, 3), dtype=np.uint8)
        out["high"] = out["high"].reshape(rows, -1)
    return out


def runs_triton(x: torch.Tensor) -> bool:
    """Whether block-quantized layers run `x` through the Triton kernel: on every device but the CPU
    (the tests also point it at CPU tensors under Triton's interpreter)."""
    return x.device.type != "cpu"


class BlockQuantLinearMethod(LinearMethod):
    """`int8_activations`: the activations are rounded to int8 per 32 values (per 256 for K-quants, as
    llama.cpp does: `Blocks.activation_span`); few-token steps then
    multiply integers (`block_quant.matmul_q8`), larger ones run the float GEMM on the rounded values
    (so a token's result does not depend on the batch it is in). Otherwise float32 activations, exact."""

    def __init__(
        self, layout: BlockLayout, int8_activations: bool = False, half: bool | None = None, int_scales: bool = False
    ) -> None:
        if not int8_activations and layout.bits in (5, 6):  # the float kernel decodes 8-bit codes faster
            layout = layout.widest(BlockLayout(8, layout.block, False))
        self.layout, self.int8_activations = layout, int8_activations
        self.bits = layout.bits
        # float16 scales (+ super-blocks) under int8 activations: fewer bytes for the memory-bound kernel;
        # the exact mode's float kernel is compute-bound and reads float32 scales in place. `half`
        # False keeps float32 scales in either mode (for scales float16 cannot hold, e.g. powers of two)
        self.half = int8_activations if half is None else half
        # one K-quant type in every shard: its sub-block scales and mins are small integers, kept as int8
        # beside the supers (1/4 bit a weight less than float16 for 4-bit codes); float16 storage only
        self.int_scales = int_scales and layout.supers
        self.fused_max_tokens = fused_max_tokens(self.bits, int8_activations)
        self.bf16_gemm = int8_activations and bfloat16_gemm()

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if input_size % 32:
            raise ValueError(f"{layer.prefix}: {input_size} columns are not whole blocks of 32")
        if self.layout.supers and input_size % SUPER:
            if input_size == layer.input_size:
                raise ValueError(f"{layer.prefix}: {input_size} columns are not whole K-quant super-blocks of {SUPER}")
            # a tensor-parallel rank's columns cut through super-blocks: hold float32 scales and offsets with
            # the super-block factors taken (exact: see `pack`), which split at any 32-value block
            self.half = False
        rows, nb, bits = sum(output_sizes), input_size // self.layout.block, self.bits
        layer.register_buffer(
            "codes",
            torch.empty(rows, input_size, dtype=torch.int8)
            if bits == 8
            else torch.empty(rows, input_size // 2, dtype=torch.uint8),
        )
        pairs = -(-input_size // 64)  # the top bits of two 32-value groups share a record of 8 or 16 bytes
        layer.register_buffer(
            "high", torch.empty(rows, pairs * (8 if bits == 5 else 16), dtype=torch.uint8) if bits in (5, 6) else None
        )
        half = self.half
        dtype = (torch.int8 if self.int_scales else torch.float16) if half else torch.float32
        if self.layout.e8m0 or self.layout.e4m3:
            dtype = torch.uint8 if self.layout.e8m0 else torch.float8_e4m3fn
        layer.register_buffer("scales", torch.empty(rows, nb, dtype=dtype))
        layer.register_buffer("offsets", torch.empty(rows, nb, dtype=dtype) if self.layout.offsets else None)
        if self.layout.e4m3:  # the e4m3 scales' factor per row
            layer.register_buffer("supers", torch.empty(rows, 1, dtype=torch.float32))
        else:
            layer.register_buffer(
                "supers",
                torch.empty(rows, input_size // SUPER, 2, dtype=torch.float16) if self.layout.supers and half else None,
            )

    def load(self, layer, weight, rows, src_rows, src_cols):
        codes = weight.codes()
        if src_cols != slice(None):  # a row-parallel layer's columns
            codes = codes.columns(src_cols)
        if codes.block % self.layout.block or LAYOUTS[weight.qtype.name].widest(self.layout) != self.layout:
            raise ValueError(f"holds {weight.qtype.name} blocks, which do not fit the layer's {self.layout}")
        self.write(layer, codes, rows, src_rows)

    def write(self, layer, codes: Codes, rows: slice, src_rows: slice = slice(None), round_half: bool = False) -> None:
        """Pack rows `src_rows` of `codes` into the layer's rows `rows` (codes whose blocks are a
        multiple of the layout's block: their scales repeat per block); `round_half`: see `pack`."""
        for name, src in pack(codes, self.layout, self.half, round_half, self.int_scales and self.half).items():
            dest = getattr(layer, name)
            if dest is not None:
                src = torch.from_numpy(np.ascontiguousarray(src[src_rows])).view(dest.dtype)
                if tuple(dest[rows].shape) != tuple(src.shape):
                    raise ValueError(f"has blocks of shape {tuple(src.shape)}, expected {tuple(dest[rows].shape)}")
                dest[rows].copy_(src)

    def process_after_loading(self, layer):
        """Under int8 activations, weights of 4-, 5- and 8-bit codes in blocks of 32, and Q6_K's, are also repacked
        into panels (`block_quant.repack_panels`, which `decode_operands` passes on too) for every step up to
        `max_tokens` rows, one-row steps included: a row's result on the panels does not depend on how
        many rows share its step, so a request's tokens do not depend on its batch (the blocks' one-row and
        multi-row kernels round differently). Steps past `max_tokens` (AMX CPUs) read the blocks. The copy holds
        0.75 bytes a weight (4-bit codes), 0.875 (5 bits), 1.07 (Q6_K) or 1.25 (8 bits), 0.125 less with
        float16 scales; $TOKENMILL_INT8_PANELS=0 keeps only the blocks."""
        wanted = self.int8_activations and os.environ.get("TOKENMILL_INT8_PANELS", "1") != "0"
        layer.panels = block_quant.repack_panels(self.blocks(layer)) if wanted else None

    def max_tokens(self, layer) -> int | None:
        """The most tokens a step of `layer` runs through the fused kernel (None: any number):
        `fused_max_tokens`, but any number on panels, which beat dequantize + float32 GEMM at 256 and 512
        rows for 6- and 8-bit codes too (Qwen2.5-0.5B's Q6_K down and Q8_0 qkv, AVX-512 VNNI and AVX2 builds:
        `benchmarks/bench_int8_panels.py`, BENCHMARKS.md), unless AMX's bfloat16 GEMM takes the large steps."""
        if getattr(layer, "panels", None) is not None and not self.bf16_gemm:
            return None
        return self.fused_max_tokens

    def blocks(self, layer) -> block_quant.Blocks:
        return block_quant.Blocks(
            layer.codes, layer.high, layer.scales, layer.offsets, layer.supers, self.bits, self.layout.center
        )

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        w = self.blocks(layer)
        if runs_triton(flat):  # GPUs: the Triton kernel on the same blocks, activations as they are
            out = triton_block.matmul(flat, w)
        elif (limit := self.max_tokens(layer)) is None or flat.shape[0] <= limit:
            panels = getattr(layer, "panels", None)  # set by process_after_loading
            if panels is not None:
                out = block_quant.matmul_q8_panels(flat, panels)
            else:
                out = (block_quant.matmul_q8 if self.int8_activations else block_quant.matmul)(flat, w)
        else:
            weight = block_quant.dequantize(w, out=block_quant.workspace(*w.shape))
            if self.bf16_gemm:  # AMX: weight and activations rounded to bfloat16
                out = (flat.to(torch.bfloat16) @ weight.to(torch.bfloat16).t()).float()
            else:
                if self.int8_activations:  # the kernel's rounding: a token's result does not depend on its batch
                    flat = block_quant.round_activations(flat, w.activation_span)
                out = flat @ weight.t()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def decode_operands(self, layer):
        panels = getattr(layer, "panels", None)
        return (
            2 if self.int8_activations else 1,
            self.bits,
            self.layout.center,
            [layer.codes, layer.high, layer.scales, layer.offsets, layer.supers]
            + ([panels.codes, panels.scales] if panels is not None else [None, None]),
            self.max_tokens(layer),
        )


class GGUFConfig(QuantizationConfig):
    """Per layer: packed when every shard of the layer has a packed type (in the widest layout among
    them), else dense. `tensor_types`: GGUF type name by checkpoint (HF) tensor name."""

    def __init__(self, tensor_types: dict[str, str], int8_activations: bool = False) -> None:
        super().__init__()
        self.name = "gguf-q8" if int8_activations else "gguf"
        self.int8_activations = int8_activations
        self.tensor_types = dict(tensor_types)
        if "lm_head.weight" not in self.tensor_types and "model.embed_tokens.weight" in self.tensor_types:
            # a tied output head reads the embedding's blocks
            self.tensor_types["lm_head.weight"] = self.tensor_types["model.embed_tokens.weight"]

    def linear_method(self, prefix: str) -> LinearMethod:
        types = [self.tensor_types.get(name) for name in self.checkpoint_names(prefix)]
        return block_method(types, self.int8_activations) or UnquantizedLinearMethod()

    def expert_method(self, prefix: str) -> LinearMethod | None:
        """The file's blocks for the routed experts too; dense experts where a layer's hold an unpacked type,
        or under tensor parallelism (a rank's share of an expert's features need not be whole blocks)."""
        if parallel_state.tp_size() > 1 and not expert_parallel.enabled():
            return None
        return expert_block_method(self.tensor_types, prefix, self.int8_activations)


def block_method(types: list[str | None], int8_activations: bool) -> BlockQuantLinearMethod | None:
    """The method holding tensors of these GGUF types in one layout (the widest of theirs); None when
    one of them is not a packed type."""
    if not types or not all(t in LAYOUTS for t in types):
        return None
    layout = LAYOUTS[types[0]]
    for t in types[1:]:
        layout = layout.widest(LAYOUTS[t])
    return BlockQuantLinearMethod(layout, int8_activations, int_scales=len(set(types)) == 1)


def expert_block_method(
    tensor_types: dict[str, str], prefix: str, int8_activations: bool
) -> BlockQuantLinearMethod | None:
    """The block method holding the routed experts of the MoE layer `prefix` (`model.layers.N.….experts`) in
    the widest layout of their GGUF types; None when one of them is not a packed type."""
    mine = f"model.layers.{next((int(p) for p in prefix.split('.') if p.isdigit()), -1)}."
    types = [t for name, t in tensor_types.items() if name.startswith(mine) and ".experts." in name]
    return block_method(types, int8_activations)


class HostExpertsConfig(QuantizationConfig):
    """`inner` (the run's format: dense on a GPU), but the routed experts of the decoder layers in
    `experts` (--cpu-moe / --n-cpu-moe: built in host memory, run there) keep a GGUF file's blocks, for
    the CPU block kernels: float32 activations, or int8 ones (`int8_activations`, gguf-q8's mode). An
    expert tensor of an unpacked type (F32, F16) leaves its layer's experts dense."""

    def __init__(
        self, inner: QuantizationConfig, tensor_types: dict[str, str], experts: frozenset[int], int8_activations: bool
    ) -> None:
        self.inner, self.tensor_types, self.experts = inner, tensor_types, experts
        self.int8_activations = int8_activations

    def __getattr__(self, name: str):  # everything else is the run's format's
        return getattr(self.__dict__["inner"], name)

    @property
    def packed_modules(self) -> dict[str, list[str]]:
        return self.inner.packed_modules

    @packed_modules.setter
    def packed_modules(self, value: dict[str, list[str]]) -> None:
        self.inner.packed_modules = value

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.inner.linear_method(prefix)

    def expert_method(self, prefix: str) -> LinearMethod | None:
        layer = next((int(p) for p in prefix.split(".") if p.isdigit()), -1)  # model.layers.N.…
        if layer not in self.experts:
            return self.inner.expert_method(prefix)
        return expert_block_method(self.tensor_types, prefix, self.int8_activations) or self.inner.expert_method(prefix)
