"""GGUF quantized tensors unpacked into integer codes with a scale and offset per block: the weight is
exactly code * scale + offset, the value gguf's dequantization gives. A K-quant keeps its two levels:
each sub-block's 6-bit (or int8) scale and min, and the super-block's float16 scale and min
(`supers`); the products are exact in float32. Checked bit for bit against `gguf.quants.dequantize`
in the tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

SUPER = 256  # values in a K-quant super-block


@dataclass
class Codes:
    """One tensor's weights as codes [N, K] (int16 values in -center .. 2**bits - center - 1) times
    scales [N, K / block], plus offsets [N, K / block] (None: zero). With `supers` [N, K / 256, 2]
    (K-quants), scales and offsets are small integers (as float32) to multiply by each super-block's
    scale (supers[..., 0]) and min (supers[..., 1]); with `row_scales` [N] (NVFP4: its e4m3 block
    scales and the tensor's float32 scale), every scale of row n is times row_scales[n] (no offsets).
    `full_scales`/`full_offsets` give the products."""

    q: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    block: int
    bits: int
    center: int = 0
    supers: np.ndarray | None = None
    row_scales: np.ndarray | None = None

    def columns(self, cols: slice) -> Codes:
        """Columns `cols` (a tensor-parallel rank's), in whole blocks. K-quant super-blocks that the
        split cuts through are folded into the blocks' scales and offsets (`full_scales`)."""
        start, stop, _ = cols.indices(self.q.shape[1])
        if start % self.block or stop % self.block:
            raise ValueError(
                f"columns {start}:{stop} are not whole blocks of {self.block} values (this split "
                f"of the {self.q.shape[1]} columns cuts through {self.bits}-bit blocks)"
            )
        codes = self
        if self.supers is not None and (start % SUPER or stop % SUPER):
            codes = replace(self, scales=self.full_scales(), offsets=self.full_offsets(), supers=None)
        blocks = slice(start // self.block, stop // self.block)
        return replace(
            codes,
            q=codes.q[:, start:stop],
            scales=codes.scales[:, blocks],
            offsets=None if codes.offsets is None else codes.offsets[:, blocks],
            supers=None if codes.supers is None else codes.supers[:, start // SUPER : stop // SUPER],
        )

    def _per_block(self, which: int) -> np.ndarray:
        return np.repeat(self.supers[..., which], SUPER // self.block, axis=1)

    def full_scales(self) -> np.ndarray:
        if self.row_scales is not None:
            return (self.scales * self.row_scales[:, None]).astype(np.float32)
        return self.scales if self.supers is None else self.scales * self._per_block(0)

    def full_offsets(self) -> np.ndarray | None:
        if self.offsets is None or self.supers is None:
            return self.offsets
        return self.offsets * self._per_block(1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-value block's 16 bytes -> its values: low nibbles are values 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack(qtype: str, raw: np.ndarray, rows: int) -> Codes:
    """The codes of a `qtype` tensor whose bytes are `raw` ([rows, bytes per row])."""
    if qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24}[qtype]
        b = raw.reshape(rows, -1, size)
        d = _f16(b[..., 0:2])
        m = _f16(b[..., 2:4]) if qtype in ("Q4_1", "Q5_1") else None
        if qtype == "Q8_0":
            return Codes(b[..., 2:].view(np.int8).astype(np.int16).reshape(rows, -1), d, None, 32, 8)
        qs = b[..., -16:]  # the block's last 16 bytes hold the low four bits
        q = _nibbles(qs).astype(np.int16)  # [rows, blocks, 32]
        if qtype in ("Q5_0", "Q5_1"):
            hbytes = b[..., 2:6] if qtype == "Q5_0" else b[..., 4:8]
            high = np.unpackbits(np.ascontiguousarray(hbytes), axis=-1, bitorder="little")
            q |= high.astype(np.int16) << 4
        center = {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
        return Codes(q.reshape(rows, -1) - center, d, m, 32, 5 if qtype.startswith("Q5") else 4, center)
    if qtype in ("Q4_K", "Q5_K"):
        size = 144 if qtype == "Q4_K" else 176
        b = raw.reshape(rows, -1, size)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, -1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(rows, -1, 8, 32).astype(np.int16)
        if qtype == "Q5_K":
            qh = b[..., 16:48].reshape(rows, -1, 1, 32)
            q |= ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1).astype(np.int16) << 4
        return Codes(
            q.reshape(rows, -1),
            sc.reshape(rows, -1),
            -mn.reshape(rows, -1),
            32,
            4 if qtype == "Q4_K" else 5,
            0,
            np.stack([d, dmin], axis=-1),
        )
    if qtype == "Q6_K":
        b = raw.reshape(rows, -1, 210)
        ql, qh = b[..., 0:128].reshape(rows, -1, 2, 1, 64), b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [.., 2, 2, 64]
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03  # [.., 2, 4, 32]
        q = (low.reshape(rows, -1, 8, 32).astype(np.int16) | (high.reshape(rows, -1, 8, 32).astype(np.int16) << 4)) - 32
        d = _f16(b[..., 208:210])
        scales = b[..., 192:208].view(np.int8).astype(np.float32).reshape(rows, -1)
        return Codes(q.reshape(rows, -1), scales, None, 16, 6, 32, np.stack([d, np.zeros_like(d)], axis=-1))
    raise ValueError(f"GGUF type {qtype} has no packed layout")
