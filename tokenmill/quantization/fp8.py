"""`fp8`: linear weights in float8 e4m3 (`torch.float8_e4m3fn`, 1 byte a weight) times float32 scales,
w = weight * scale, activations kept in the compute dtype (weights only: no activation rounding).

- On load (`--quantization fp8` on a dense HF checkpoint): one scale per output row (per channel),
  absmax / 448, every linear layer including the LM head.
- FP8 checkpoints (`quantization_config.quant_method` "fp8", as DeepSeek-V3 and transformers'
  FineGrainedFP8 write them): `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
  [ceil(out/128), ceil(in/128)], the multiplier of each 128x128 block (`weight_block_size`); or, as
  vLLM's per-tensor / per-channel fp8 checkpoints, `weight_scale` of shape [] / [1] or [out, 1].
  Layers without a scale tensor (the LM head, `modules_to_not_convert`) stay dense. `input_scale`
  (the static activation scheme) is read and ignored: activations are never rounded here. A
  tensor-parallel rank may take any columns under per-tensor / per-channel scales, whole blocks under
  block scales. compressed-tensors fp8 layers (`compressed_tensors.py`) come here too.
The layer stores `weight` [N, K] and `scales` float32 [N, ceil(K / group)]: group K per channel (or
tensor), 128 for blocks, each block's scale repeated over its rows (4 bytes per 128 x 1 values).

CPU (float32 activations): the C++ kernel `tokenmill.kernels.fp8_matmul` dequantizes inside the
matmul for up to FUSED_MAX_TOKENS tokens, else dequantizes once into the shared float32 workspace
and runs torch's GEMM; both compute on exactly `weight.float() * scale`. CUDA (`cuda_kernel` picks):
`torch._scaled_mm` (both operands e4m3, activations rounded per token, row-wise scales) where the GPU
has fp8 tensor cores (compute capability 8.9+), for per-channel (or per-tensor) scales in bfloat16;
else the Triton block GEMM (`kernels/triton_block.fp8_matmul`: the weight's bytes decoded and its
block scales applied inside the K loop, activations unrounded); the weight is dequantized per call only
without Triton. The selection, the `_scaled_mm` arithmetic (torch runs it on CPU too) and the Triton
kernel (in its interpreter) are tested on CPU; the CUDA paths have not run in this project's CI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels import block_quant, fp8_matmul, triton_block
from tokenmill.quantization.base import LinearMethod, QuantizationConfig, dense
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

E4M3_MAX = 448.0
FUSED_MAX_TOKENS = 16  # batches up to this many tokens run the fused kernel on CPU
SCALE_KINDS = ("weight_scale_inv", "weight_scale")
_ALL = slice(None)


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError when fp8 weights cannot run on `device` in `dtype`."""
    if device.type == "cpu":
        if dtype != torch.float32:
            raise ValueError(
                f"--quantization fp8 runs its CPU kernel on float32 activations; got {dtype} "
                "(use --dtype float32 or auto)"
            )
        if fp8_matmul.load() is None:
            raise ValueError(
                "--quantization fp8 needs the C++ CPU kernel, which could not be built here "
                "(see the warning above); use --quantization none"
            )
    elif device.type != "cuda":
        raise ValueError(f"--quantization fp8 runs on CPU or CUDA, not on {device.type}")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as (float8_e4m3fn [N, K], float32 scales [N]): per row absmax / 448 (1 for an
    all-zero row), values rounded to nearest even e4m3."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def cuda_kernel(dtype: torch.dtype, groups: int, n: int, k: int, scaled_mm: bool, triton: bool) -> str:
    """Which CUDA path runs an fp8 layer of [n, k] weights with `groups` scales per row, on `dtype`
    activations: "scaled_mm" (fp8 tensor cores, `scaled_mm` says the GPU has them; row-wise scales only,
    bfloat16 output, dims multiples of 16), "triton" (any scales and dtype), or "dequantize"."""
    if scaled_mm and groups == 1 and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    return "triton" if triton else "dequantize"


def scaled_mm_linear(
    x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] @ (e4m3 `weight` [N, K] times `row_scales` [N, 1]).T (+ bias) on fp8 tensor cores: each
    token's activations rounded to e4m3 with its own scale (absmax / 448), both scales applied to the
    float32 accumulator by `torch._scaled_mm`."""
    sx = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    xq = (x.float() / sx).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=row_scales.view(1, -1), bias=bias, out_dtype=dtype)


class FP8LinearMethod(LinearMethod):
    """`scale_kind` None: quantize a dense weight on load (per channel); else the checkpoint's scale
    tensor name (`SCALE_KINDS`), with `block` (rows, columns) per scale for block-scaled checkpoints."""

    def __init__(self, scale_kind: str | None = None, block: tuple[int, int] | None = None) -> None:
        self.scale_kind, self.block = scale_kind, block
        if scale_kind is not None:
            self.checkpoint_kinds = ("weight", scale_kind)
            self.optional_kinds = ("input_scale",)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        rows = sum(output_sizes)
        layer.fp8_group = self.block[1] if self.block else input_size
        groups = -(-input_size // layer.fp8_group)
        layer.register_buffer("weight", torch.empty(rows, input_size, dtype=torch.float8_e4m3fn))
        layer.register_buffer("scales", torch.empty(rows, groups, dtype=torch.float32))

    def load(self, layer, weight, rows, src_rows, src_cols):
        if self.scale_kind is None:
            q, scale = quantize(dense(weight)[src_rows, src_cols])
            self._copy(layer.scales, rows, scale[:, None].expand(-1, layer.scales.shape[1]))
        else:
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"is {weight.dtype}, but an fp8 checkpoint's weights are float8_e4m3fn")
            q = weight[src_rows][:, src_cols]
        self._copy(layer.weight, rows, q)

    def load_part(self, layer, kind, weight, rows, src_rows, src_cols):
        if kind == "input_scale":
            return
        if kind != self.scale_kind:
            return super().load_part(layer, kind, weight, rows, src_rows, src_cols)
        s = weight.float()
        groups = layer.scales.shape[1]
        if s.numel() == 1:  # per tensor
            per_row = s.reshape(1, 1).expand(src_rows.stop - src_rows.start, groups)
        elif s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1):  # per channel
            per_row = s.reshape(-1, 1)[src_rows].expand(-1, groups)
        elif s.dim() == 2 and self.block is not None:  # per block of block[0] x block[1]
            s = s[:, self._block_cols(src_cols)]
            if s.shape[1] != groups:
                raise ValueError(
                    f"has {s.shape[1]} column blocks, expected {groups} ({layer.input_size_per_partition} "
                    f"columns in blocks of {self.block[1]})"
                )
            per_row = s.repeat_interleave(self.block[0], dim=0)[src_rows]
        else:
            raise ValueError(
                f"has shape {tuple(s.shape)}, which is no fp8 scale layout this reads (per tensor, "
                "per channel [out, 1] or per block with weight_block_size)"
            )
        self._copy(layer.scales, rows, per_row)

    def _block_cols(self, src_cols: slice) -> slice:
        """The column blocks of a tensor-parallel rank's columns `src_cols`, which must start on a block."""
        if src_cols == _ALL:
            return _ALL
        if src_cols.start % self.block[1]:
            raise ValueError(
                f"cannot be split by columns at {src_cols.start} (tensor parallelism): its scales cover "
                f"blocks of {self.block[1]} columns"
            )
        return slice(src_cols.start // self.block[1], -(-src_cols.stop // self.block[1]))

    @staticmethod
    def _copy(dest: torch.Tensor, rows: slice, src: torch.Tensor) -> None:
        if tuple(dest[rows].shape) != tuple(src.shape):
            raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest[rows].shape)}")
        dest[rows].copy_(src)

    def dequantized(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`, with torch ops (any device)."""
        scales = layer.scales.repeat_interleave(layer.fp8_group, dim=1)[:, : layer.weight.shape[1]]
        return (layer.weight.float() * scales).to(dtype)

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1])
        if x.device.type == "cpu":
            flat = flat.contiguous()
            if flat.shape[0] <= FUSED_MAX_TOKENS:
                out = fp8_matmul.matmul(flat, layer.weight, layer.scales, layer.fp8_group)
            else:
                w = fp8_matmul.dequantize(
                    layer.weight, layer.scales, layer.fp8_group, out=block_quant.workspace(*layer.weight.shape)
                )
                out = flat @ w.t()
            if bias is not None:
                out += bias
            return out.view(*x.shape[:-1], out.shape[-1])
        (n, k), groups = layer.weight.shape, layer.scales.shape[1]
        kernel = cuda_kernel(x.dtype, groups, n, k, _scaled_mm_supported(x.device), triton_block.available())
        if kernel == "scaled_mm":
            out = scaled_mm_linear(flat, layer.weight, layer.scales, bias, x.dtype)
        elif kernel == "triton":
            out = triton_block.fp8_matmul(flat, layer.weight, layer.scales, layer.fp8_group)
            if bias is not None:
                out += bias
        else:
            out = F.linear(flat, self.dequantized(layer, x.dtype), bias)
        return out.view(*x.shape[:-1], out.shape[-1])


class FP8Config(QuantizationConfig):
    """`raw`: an fp8 checkpoint's quantization_config (None: quantize a dense checkpoint on load);
    `tensor_names`: the checkpoint's tensors (which layers carry scales)."""

    name = "fp8"

    def __init__(self, raw: dict | None = None, tensor_names: set[str] | None = None) -> None:
        super().__init__()
        self.raw, self.tensor_names = raw, tensor_names or set()
        self.block: tuple[int, int] | None = None
        if raw is None:
            return
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoints with fmt {fmt!r} are not supported (e4m3)")
        block = raw.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"fp8 weight_block_size must be two positive integers; got {block!r}")
            self.block = (block[0], block[1])
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.raw is None:
            return FP8LinearMethod()
        bases = [n.removesuffix(".weight") for n in self.checkpoint_names(prefix)]
        for kind in SCALE_KINDS:
            found = [f"{b}.{kind}" in self.tensor_names for b in bases]
            if all(found):
                return FP8LinearMethod(kind, self.block if kind == "weight_scale_inv" else None)
            if any(found):
                raise ValueError(f"{prefix}: only some of its checkpoint tensors {', '.join(bases)} have a {kind}")
        return UnquantizedLinearMethod()
