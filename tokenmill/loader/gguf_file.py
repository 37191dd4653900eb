"""A GGUF file's header, parsed as its spec lays it out (ggml's docs/gguf.md, versions 2 and 3):
metadata key/value pairs and the tensor table, read with `struct` from a memory map; each tensor's
data is a numpy view of the map (nothing is read until used). gguf-py's `GGUFReader` builds a numpy
view per array element and took ~5 s on SmolLM2's 49k-token vocabulary and merges, on every load;
this reads that header in ~0.1 s. The tensor types and their block sizes are gguf-py's.

Float tensors (F32, F16, BF16) are also given as torch tensors viewing a second, private
(copy-on-write) map of the file (`values`): a model can use them without a copy, a write to one never
reaches the file, and that map stays open while any of them lives. It is a map of its own so that the
pages read through the header's map (the quantized blocks the loader repacks) are let go with it."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# metadata value types (the spec's gguf_metadata_value_type): fixed-size scalars by struct format;
# 8 is a string (u64 length + UTF-8 bytes), 9 an array (element type u32, count u64, elements)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # in torch order (the file lists the fastest-moving dimension first)
    data: np.ndarray  # float32 / float16 values, or the blocks' bytes: uint8 [..., bytes per row]
    start: int  # where its data starts in the file


class GGUFFile:
    """`fields`: metadata by key (numbers, strings, lists); `tensors`: in file order. Where the header's
    parts lie, for copying them: `field_spans` (each key/value pair's bytes), `table_span` (the tensor
    table's), `data_start` (the tensor data's, which the table's offsets count from)."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._private_map: mmap.mmap | None = None
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise ValueError("it does not start with the GGUF magic bytes")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"it is GGUF version {version}; versions 2 and 3 are read (little-endian)")
        tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        self.field_spans: dict[str, tuple[int, int]] = {}
        for _ in range(field_count):
            start = self._pos
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
            self.field_spans[key] = (start, self._pos)
        start = self._pos
        table = [self._tensor_entry() for _ in range(tensor_count)]
        self.table_span = (start, self._pos)
        self.alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        self.data_start = -(-self._pos // self.alignment) * self.alignment
        self.tensors = [
            self._tensor(name, ggml_type, shape, self.data_start + offset) for name, ggml_type, shape, offset in table
        ]

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise ValueError("it ends inside its header (truncated?)")
        out = self._map[self._pos : self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._read(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            element, count = self._unpack("<I"), self._unpack("<Q")
            if element in _SCALARS:  # one read for the whole array
                fmt = _SCALARS[element]
                return np.frombuffer(self._read(count * struct.calcsize(fmt)), dtype=np.dtype(fmt)).tolist()
            return [self._value(element) for _ in range(count)]
        raise ValueError(f"it holds a metadata value of unknown type {kind}")

    def _tensor_entry(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
        ggml_type, offset = self._unpack("<I"), self._unpack("<Q")
        return name, ggml_type, tuple(reversed(dims)), offset

    def _tensor(self, name: str, ggml_type: int, shape: tuple[int, ...], start: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown GGML type {ggml_type}") from None
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype, item_shape = (np.float32 if qtype == GGMLQuantizationType.F32 else np.float16), shape
        else:  # blocks (and the other types) as bytes, a row of blocks per row
            dtype, item_shape = np.uint8, quant_shape_to_byte_shape(shape, qtype)
        count = int(np.prod(item_shape))
        if start + count * np.dtype(dtype).itemsize > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(item_shape)
        return GGUFTensor(name, qtype, shape, data, start)

    def values(self, tensor: GGUFTensor) -> torch.Tensor | None:
        """A float tensor's values as stored (float32 / float16 / bfloat16), viewing the file's private
        map; None for quantized blocks."""
        dtype = _FLOATS.get(tensor.tensor_type)
        if dtype is None:
            return None
        if self._private_map is None:
            with open(self.path, "rb") as f:
                self._private_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = int(np.prod(tensor.shape))
        return torch.frombuffer(self._private_map, dtype=dtype, count=count, offset=tensor.start).view(tensor.shape)
