"""AWQ and GPTQ checkpoints (HF directories whose config.json has a `quantization_config`), unpacked
on load into the block layout of the integer kernels (`gguf.BlockLayout`), never through a dense
float weight (`packed_checkpoint.py`). Both store w = (q - z) * s with one scale s and zero z per group of input columns:

- AWQ (AutoAWQ's GEMM layout, 4 bits): `qweight` int32 [in, out/8], eight outputs per word in the
  order 0, 2, 4, 6, 1, 3, 5, 7 of the nibbles; `qzeros` int32 [in/group, out/8], packed alike;
  `scales` float16 [in/group, out].
- GPTQ (AutoGPTQ, 4 or 8 bits): `qweight` int32 [in*bits/32, out], consecutive inputs in a word;
  `qzeros` int32 [groups, out*bits/32], consecutive outputs; `scales` float16 [groups, out];
  `g_idx` int32 [in], each input column's group. The "gptq" checkpoint format stores z - 1 (the
  original packer's offset), "gptq_v2" z itself. With act-order (`desc_act`) the groups are not runs
  of columns: the columns are sorted by group on load, and each step's activations are permuted the
  same way before the matmul (shards of one fused layer share their input, so GPTQ gives them one
  order; a checkpoint where they differ is refused).

Symmetric checkpoints (every zero the middle code) keep no offsets: codes are centred, as Q4_0.
In the exact mode (`--dtype float32`) scales and offsets stay float32 (w exactly as the checkpoint
defines it); in the default fast mode they are float16, the offset -z * s rounded (at most 1/256
of a quantization step), since the activations are rounded to int8 there anyway.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.gguf import BlockLayout
from tokenmill.quantization.gguf_codes import Codes
from tokenmill.quantization.packed_checkpoint import PackedCheckpointMethod, PackedFormat
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # output 8j + AWQ_ORDER[i] sits in nibble i of word j


def unpack_words(words: torch.Tensor, bits: int) -> np.ndarray:
    """int32 words [..., n] -> their values [..., n, 32 / bits], value i from bits i*bits upwards."""
    u = words.numpy().astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(32 // bits) * bits
    return ((u[..., None] >> shifts) & (2**bits - 1)).astype(np.int16)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple:
    """(q [out, in], zeros [out, groups], scales [out, groups]) of an AWQ layer."""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints have 4-bit weights, this one says {bits}")
    inverse = np.argsort(AWQ_ORDER)
    q = unpack_words(qweight, 4)[..., inverse].reshape(qweight.shape[0], -1)
    z = unpack_words(qzeros, 4)[..., inverse].reshape(qzeros.shape[0], -1)
    return q.T, z.T, scales.float().numpy().T


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, zero_offset: int) -> tuple:
    """(q [out, in], zeros [out, groups], scales [out, groups]) of a GPTQ layer."""
    q = unpack_words(qweight, bits).transpose(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    z = unpack_words(qzeros, bits).reshape(qzeros.shape[0], -1) + zero_offset
    return q.T, z.T, scales.float().numpy().T


def to_codes(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, symmetric: bool) -> Codes:
    """w = (q - z) * s per group as `Codes` (offsets -z * s, or centred codes when symmetric)."""
    group = q.shape[1] // scales.shape[1]
    middle = 2 ** (bits - 1)
    if symmetric:
        if not np.all(zeros == middle):
            raise ValueError(f"says sym but holds zeros other than {middle}")
        return Codes(q - middle, scales, None, group, bits, 0 if bits == 8 else middle)
    shift = middle if bits == 8 else 0  # 8-bit codes are stored signed
    return Codes(q - shift, scales, (shift - zeros) * scales, group, bits)


class AWQGPTQConfig(QuantizationConfig, PackedFormat):
    """From a checkpoint's `quantization_config`; layers without a `qweight` (the LM head, any
    `modules_to_not_convert`) stay dense. `exact`: float32 activations and scales."""

    half = True
    g_idx_kind = "g_idx"

    def __init__(self, method: str, raw: dict, tensor_names: set[str], exact: bool) -> None:
        super().__init__()
        self.name, self.exact, self.tensor_names = method, exact, tensor_names
        self.bits = int(raw.get("bits", raw.get("w_bit", 4)))
        if self.bits not in (4, 8):
            raise ValueError(f"{method} checkpoints with {self.bits}-bit weights are not supported (4 or 8)")
        group = int(raw.get("group_size", raw.get("q_group_size", 128)))
        self.group_size = None if group <= 0 else group
        if method == "awq":
            self.symmetric, self.act_order = not raw.get("zero_point", True), False
        else:
            self.symmetric, self.act_order = bool(raw.get("sym", True)), bool(raw.get("desc_act", False))
            fmt = raw.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
            self.zero_offset = 1 if fmt == "gptq" else 0
        center = 2 ** (self.bits - 1) if self.symmetric and self.bits < 8 else 0
        self.layout = BlockLayout(self.bits, 32, not self.symmetric, center)
        self.kinds = ("qweight", "qzeros", "scales") + (("g_idx",) if self.act_order else ())
        self.optional_kinds = () if self.act_order else ("g_idx",)

    def codes(self, parts: dict[str, torch.Tensor]) -> Codes:
        args = parts["qweight"], parts["qzeros"], parts["scales"], self.bits
        q, zeros, scales = awq_codes(*args) if self.name == "awq" else gptq_codes(*args, self.zero_offset)
        return to_codes(q, zeros, scales, self.bits, self.symmetric)

    def linear_method(self, prefix: str) -> LinearMethod:
        names = [n.removesuffix(".weight") + ".qweight" for n in self.checkpoint_names(prefix)]
        if all(n in self.tensor_names for n in names):
            return PackedCheckpointMethod(self, not self.exact)
        return UnquantizedLinearMethod()
