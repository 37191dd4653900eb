"""`compressed-tensors` checkpoints, as llm-compressor writes them: config.json's quantization_config
has quant_method "compressed-tensors", `config_groups` (each: `targets`, the `weights` arguments -
num_bits, type int/float, symmetric, strategy tensor/channel/group/block, group_size,
block_structure, actorder - and optionally its own `format`), a top-level `format` and `ignore`.
A target or ignore entry is a module name, "re:<regex>" (matched from the name's start) or the
class name "Linear" (every linear layer); the first group that targets a layer gives its scheme.

The weight formats read, each into the method that holds exactly the same weights:
- float-quantized (fp8 e4m3): `weight` float8_e4m3fn, `weight_scale` per tensor, per channel
  [out, 1] or per block [out / b0, in / b1] (`block_structure`) -> the `fp8` method.
- pack-quantized (int 4 / 8 bits): `weight_packed` int32 [out, in * bits / 32], value i of a row at
  bits i * bits, each stored plus 2^(bits-1); `weight_scale` [out, groups] (one column per
  channel, one value per tensor); asymmetric: `weight_zero_point` packed alike along the output
  rows [out * bits / 32, groups]; `weight_shape`; `weight_g_idx` (actorder "group"): each column's
  group. w = (q - zero_point) * scale, q and zero_point signed.
- naive-quantized / int-quantized (int 8 bits): the same with the codes as an int8 `weight`.
  Both go to the block kernels (`packed_checkpoint.PackedCheckpointMethod`).
- nvfp4-pack-quantized: `weight_packed` uint8 [out, in / 2] (two e2m1 values a byte, `fp4.unpack_e2m1`),
  `weight_scale` float8_e4m3fn [out, in / 16], `weight_global_scale` float32 [1]:
  w = e2m1 * weight_scale / weight_global_scale.
- mxfp4-pack-quantized: the same values, `weight_scale` uint8 E8M0 [out, in / 32]: w = e2m1 * 2^(s - 127).
  Both as integer codes 2 * e2m1 times scale / 2 on the block kernels, as `fp4` does on load.
Activation quantization (`input_activations`: W8A8, W4A4) is not applied: activations run as each
method runs them (int8 per 32 values on the block kernels by default, float32 with `--dtype
float32`; float32 for fp8), closer to the unquantized model than the checkpoint asks. Static
`input_scale` / `input_global_scale` tensors are read and ignored. Not read: sparse checkpoints
(`sparsity_config`), `kv_cache_scheme` scales (use `--kv-cache-dtype`), the "dense" (not compressed)
status, mxfp6 / mxfp8, 2- and 3-bit ints, asymmetric FP4.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from tokenmill.quantization import fp4
from tokenmill.quantization.awq_gptq import to_codes, unpack_words
from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.gguf import BlockLayout
from tokenmill.quantization.gguf_codes import Codes
from tokenmill.quantization.packed_checkpoint import PackedCheckpointMethod, PackedFormat
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
FP4_FORMATS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}
FORMATS = ("float-quantized", *INT_FORMATS, *FP4_FORMATS)
STATIC_INPUT_KINDS = ("input_scale", "input_zero_point", "input_global_scale")


class IntFormat(PackedFormat):
    def __init__(self, fmt: str, weights: dict, where: str) -> None:
        self.name, self.bits = f"compressed-tensors {fmt}", int(weights.get("num_bits", 8))
        if self.bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
            raise ValueError(
                f"{where}: {fmt} with {self.bits}-bit weights is not supported "
                f"({'4 or 8' if fmt == 'pack-quantized' else '8'} bits)"
            )
        strategy = weights.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(
                f"{where}: integer weights with strategy {strategy!r} are not supported (tensor, channel, group)"
            )
        self.group_size = int(weights["group_size"]) if strategy == "group" else None
        self.symmetric = bool(weights.get("symmetric", True))
        self.half = True
        self.layout = BlockLayout(
            self.bits, 32, not self.symmetric, 2 ** (self.bits - 1) if self.symmetric and self.bits < 8 else 0
        )
        self.data_kind = "weight_packed" if fmt == "pack-quantized" else "weight"
        zero = () if self.symmetric else ("weight_zero_point",)
        self.kinds = (self.data_kind, "weight_scale", *zero)
        self.optional_kinds = (
            "weight_shape",
            "weight_g_idx",
            *STATIC_INPUT_KINDS,
            *(("weight_zero_point",) if self.symmetric else ()),
        )
        self.g_idx_kind = "weight_g_idx"

    def codes(self, parts: dict[str, torch.Tensor]) -> Codes:
        middle = 2 ** (self.bits - 1)
        data = parts[self.data_kind]
        if self.data_kind == "weight_packed":
            q = unpack_words(data, self.bits).reshape(data.shape[0], -1) - middle
        else:
            q = data.numpy().astype(np.int16)
        rows = q.shape[0]
        if "weight_shape" in parts:
            shape = tuple(int(v) for v in parts["weight_shape"].tolist())
            if len(shape) != 2 or shape[0] != rows or shape[1] > q.shape[1]:
                raise ValueError(f"weight_shape {shape} does not fit the {self.data_kind} of {rows} rows")
            q = q[:, : shape[1]]
        scales = parts["weight_scale"].float().numpy()
        scales = np.broadcast_to(
            scales.reshape(rows, -1) if scales.size > 1 else scales.reshape(1, 1), (rows, max(1, scales.size // rows))
        ).astype(np.float32)
        zeros = np.zeros(scales.shape, dtype=np.int64)
        if "weight_zero_point" in parts:
            z = parts["weight_zero_point"]
            if self.data_kind == "weight_packed" and z.dtype == torch.int32:
                z = unpack_words(z.t().contiguous(), self.bits).reshape(z.shape[1], -1)[:, :rows].T - middle
            else:
                z = z.numpy().reshape(-1, scales.shape[1]) if z.numel() > 1 else z.numpy().reshape(1, 1)
            zeros = np.broadcast_to(z, scales.shape).astype(np.int64)
            if self.symmetric and zeros.any():
                raise ValueError("is symmetric but holds zero points other than 0")
        if q.shape[1] % scales.shape[1]:
            raise ValueError(f"has {scales.shape[1]} scale columns for {q.shape[1]} input columns")
        return to_codes(q + middle, zeros + middle, scales, self.bits, self.symmetric)


class FP4Format(PackedFormat):
    def __init__(self, fmt: str, weights: dict, where: str) -> None:
        self.name, block = f"compressed-tensors {fmt}", FP4_FORMATS[fmt]
        if int(weights.get("num_bits", 4)) != 4 or weights.get("type", "float") != "float":
            raise ValueError(f"{where}: {fmt} needs 4-bit float weights")
        if not weights.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric FP4 weights are not supported")
        self.nvfp4, self.group_size, self.half = fmt.startswith("nv"), block, False
        self.method = "nvfp4" if self.nvfp4 else "mxfp4"
        self.layout = fp4.LAYOUTS[self.method]
        self.kinds = ("weight_packed", "weight_scale") + (("weight_global_scale",) if self.nvfp4 else ())
        self.optional_kinds = STATIC_INPUT_KINDS

    def codes(self, parts: dict[str, torch.Tensor]) -> Codes:
        q = fp4.unpack_e2m1(parts["weight_packed"])
        s = parts["weight_scale"]
        tensor_scale = 1.0
        if self.nvfp4:  # the e4m3 scales, and the tensor's 1 / global scale (as NVFP4 kernels multiply it)
            if s.dtype != torch.float8_e4m3fn:
                raise ValueError(f"is {s.dtype}, but NVFP4 scales are float8_e4m3fn")
            scales = s.float()
            if not torch.isfinite(scales).all() or (scales < 0).any():
                raise ValueError("holds a negative or NaN e4m3 block scale")
            tensor_scale = float(1 / parts["weight_global_scale"].float().reshape(()))
        else:
            if s.dtype != torch.uint8:
                raise ValueError(f"is {s.dtype}, but MXFP4 scales are uint8 E8M0 exponents")
            if (s == 255).any():
                raise ValueError("holds the E8M0 NaN scale (255)")
            scales = torch.ldexp(torch.ones(s.shape), s.to(torch.int32) - 127)
        if tuple(scales.shape) != (q.shape[0], q.shape[1] // self.group_size):
            raise ValueError(
                f"has shape {tuple(s.shape)}, expected {(q.shape[0], q.shape[1] // self.group_size)} "
                f"(one scale per {self.group_size} values)"
            )
        return fp4.fp4_codes(q, scales.numpy(), self.method, tensor_scale)


class CompressedTensorsConfig(QuantizationConfig):
    """`raw`: the checkpoint's quantization_config; `tensor_names`: its tensors (a targeted layer
    stored without its format's tensors stays dense); `device`, `dtype`: where the model runs;
    `exact`: float32 activations on the block kernels."""

    name = "compressed-tensors"

    def __init__(
        self, raw: dict, tensor_names: set[str], device: torch.device, dtype: torch.dtype, exact: bool
    ) -> None:
        from tokenmill.quantization import check_block_kernels
        from tokenmill.quantization.fp8 import check_device

        super().__init__()
        self.tensor_names, self.exact = tensor_names, exact
        if raw.get("sparsity_config"):
            raise ValueError("sparse compressed-tensors checkpoints (sparsity_config) are not supported")
        if raw.get("kv_cache_scheme"):
            raise ValueError(
                "compressed-tensors kv_cache_scheme (stored KV scales) is not supported; drop it from "
                "the quantization_config and choose --kv-cache-dtype instead"
            )
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("a compressed-tensors quantization_config needs config_groups")
        self.ignore = list(raw.get("ignore") or [])
        self.groups: list[tuple[list[str], str, dict]] = []
        for gname, group in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            weights, fmt = group.get("weights"), group.get("format") or raw.get("format")
            if not weights:
                continue  # activations only: the weights stay dense
            if fmt not in FORMATS:
                raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
            kind = weights.get("type", "int")
            if fmt == "float-quantized" and (kind != "float" or int(weights.get("num_bits", 8)) != 8):
                raise ValueError(f"{where}: float-quantized weights must be 8-bit floats (e4m3)")
            self.groups.append((list(group.get("targets") or []), fmt, self._scheme(fmt, weights, where)))
        if any(fmt == "float-quantized" for _, fmt, _ in self.groups):
            check_device(device, dtype)
        if any(fmt != "float-quantized" for _, fmt, _ in self.groups):
            check_block_kernels("a compressed-tensors checkpoint with integer or FP4 weights", device, dtype)

    @staticmethod
    def _scheme(fmt: str, weights: dict, where: str):
        if fmt in INT_FORMATS:
            return IntFormat(fmt, weights, where)
        if fmt in FP4_FORMATS:
            return FP4Format(fmt, weights, where)
        strategy = weights.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(
                f"{where}: fp8 weights with strategy {strategy!r} are not supported (tensor, channel, block)"
            )
        block = weights.get("block_structure") if strategy == "block" else None
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: block_structure must be two positive integers; got {block!r}")
        return None if block is None else (block[0], block[1])

    def _group_of(self, module: str) -> int | None:
        """The index of the config group that quantizes checkpoint module `module`, if any."""
        if any(_matches(module, t) for t in self.ignore):
            return None
        for i, (targets, _, _) in enumerate(self.groups):
            if any(_matches(module, t) for t in targets):
                return i
        return None

    def linear_method(self, prefix: str) -> LinearMethod:
        from tokenmill.quantization.fp8 import FP8LinearMethod

        bases = [n.removesuffix(".weight") for n in self.checkpoint_names(prefix)]
        found = {self._group_of(b) for b in bases}
        if len(found) > 1:
            raise ValueError(
                f"{prefix}: its checkpoint modules {', '.join(bases)} fall in different compressed-tensors "
                "config_groups, which one fused layer cannot hold"
            )
        index = found.pop()
        if index is None:
            return UnquantizedLinearMethod()
        _, fmt, scheme = self.groups[index]
        if not all(f"{b}.weight_scale" in self.tensor_names for b in bases):
            return UnquantizedLinearMethod()  # targeted, yet stored dense (e.g. a head kept in full precision)
        if fmt == "float-quantized":
            method = FP8LinearMethod("weight_scale", scheme)
            method.optional_kinds = STATIC_INPUT_KINDS
            return method
        return PackedCheckpointMethod(scheme, not self.exact)


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (target == "Linear" and not module.endswith("embed_tokens"))
