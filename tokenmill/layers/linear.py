"""Linear layers. Each asks the model's `QuantizationConfig` for its `LinearMethod`, which creates
and owns the weight storage; the layer keeps the sizes, the bias and the mapping from checkpoint
tensors to its rows and columns (`weight_loader`):

- `ReplicatedLinear`: the whole weight on every rank.
- `ColumnParallelLinear`: output rows split across tensor-parallel ranks;
  `MergedColumnParallelLinear` fuses several checkpoint tensors along the rows (gate + up), and
  `QKVParallelLinear` fuses q, k and v by heads (k/v heads replicated when there are fewer than ranks).
- `RowParallelLinear`: input columns split across ranks; partial outputs are summed with one
  all-reduce (torch.distributed), then the bias is added once.

A layer given LoRA adapters (`tokenmill.lora`) has a `lora` that adds each token's adapter delta to
its output, after the weight format's matmul.

The parallel kinds take their rank and size from the process's tensor-parallel group
(`tokenmill.distributed.parallel_state`) unless given; with none set up (size 1) every kind holds
the whole weight.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import parallel_state
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedConfig, load_dense

_ALL = slice(None)


class LinearBase(nn.Module):
    lora = None  # a `lora.weights.LoRAWeights` when the engine serves LoRA adapters

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        """`tp_rank`, `tp_size`: the rank's place in the tensor-parallel group (default: this
        process's; a replicated layer always has the whole weight: rank 0 of 1)."""
        super().__init__()
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if tp_size is None:
            tp_rank, tp_size = parallel_state.tp_rank(), parallel_state.tp_size()
        self.tp_rank, self.tp_size = tp_rank or 0, tp_size
        self._check_split()
        self.input_size_per_partition = self._input_partition()[0]
        self.output_partition_sizes = [self._output_partition(i)[0] for i in range(len(self.output_sizes))]
        self.quant_method = (quant_config or UnquantizedConfig()).linear_method(prefix)
        self.quant_method.create_weights(
            self, self.input_size_per_partition, self.output_partition_sizes, torch.get_default_dtype()
        )
        rows = sum(self.output_partition_sizes)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None

    def _check_split(self) -> None:
        """Raise, naming the layer, if its weight does not split over the tensor-parallel ranks."""

    def _output_partition(self, shard: int) -> tuple[int, int]:
        """(rows this rank holds of shard `shard`, first of them in the checkpoint tensor)."""
        return self.output_sizes[shard], 0

    def _input_partition(self) -> tuple[int, int]:
        """(columns this rank holds, first of them in the checkpoint tensor)."""
        return self.input_size, 0

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def weight_loader(self, kind: str, weight, shard: int | None = None) -> None:
        """Load checkpoint tensor `weight` ("weight", "bias" or a part its weight format reads) into shard `shard` of this layer; with
        shard None into every shard of a fused layer (a checkpoint that stores them fused, as Phi-3)."""
        if shard is None and self.num_shards > 1:
            for i in range(self.num_shards):
                self._load_shard(kind, weight, i, sum(self.output_sizes[:i]))
        else:
            self._load_shard(kind, weight, shard or 0, 0)

    def _load_shard(self, kind: str, weight, shard: int, src_offset: int) -> None:
        """Shard `shard` from `weight`, whose rows for it start at `src_offset`."""
        size, src_start = self._output_partition(shard)
        src_start += src_offset
        start = sum(self.output_partition_sizes[:shard])
        rows, src_rows = slice(start, start + size), slice(src_start, src_start + size)
        if kind == "bias":
            load_dense(self.bias, weight, rows, (src_rows,))
            return
        cols, col_start = self._input_partition()
        src_cols = _ALL if cols == self.input_size else slice(col_start, col_start + cols)
        if kind == "weight":
            self.quant_method.load(self, weight, rows, src_rows, src_cols)
        else:
            self.quant_method.load_part(self, kind, weight, rows, src_rows, src_cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)


class ReplicatedLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix, tp_rank=0, tp_size=1)


class ColumnParallelLinear(LinearBase):
    def _check_split(self):
        for size in self.output_sizes:
            if size % self.tp_size:
                raise ValueError(f"{self.prefix}: {size} output rows do not split over {self.tp_size} ranks")

    def _output_partition(self, shard):
        size = self.output_sizes[shard] // self.tp_size
        return size, self.tp_rank * size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint tensors stacked along the rows (e.g. gate_proj and up_proj)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul: shards 0, 1, 2. Each rank holds num_heads / tp query heads
    and max(1, num_kv_heads / tp) key/value heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *args, **kwargs) -> None:
        """`args`, `kwargs`: `LinearBase`'s after the output sizes (bias, quant_config, prefix, tp_rank,
        tp_size); the output sizes are those of the q, k and v heads."""
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], *args, **kwargs)

    def _check_split(self):
        heads, kv_heads, tp = self.num_heads, self.num_kv_heads, self.tp_size
        if heads % tp or (kv_heads % tp and tp % kv_heads):
            raise ValueError(f"{self.prefix}: {heads} query / {kv_heads} kv heads do not split over {tp} ranks")

    def _output_partition(self, shard):
        if shard == 0:
            return super()._output_partition(0)
        if self.num_kv_heads >= self.tp_size:
            heads = self.num_kv_heads // self.tp_size
            return heads * self.head_dim, self.tp_rank * heads * self.head_dim
        # fewer kv heads than ranks: each kv head is replicated on tp / num_kv_heads ranks
        return self.head_dim, self.tp_rank // (self.tp_size // self.num_kv_heads) * self.head_dim


class RowParallelLinear(LinearBase):
    def _check_split(self):
        if self.input_size % self.tp_size:
            raise ValueError(f"{self.prefix}: {self.input_size} input columns do not split over {self.tp_size} ranks")

    def _input_partition(self):
        cols = self.input_size // self.tp_size
        return cols, self.tp_rank * cols

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output, not yet summed over the ranks (the bias in rank 0's), for
        callers that add several such terms and all-reduce once."""
        return self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = parallel_state.all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
