"""Mixture-of-experts: routing (top-k over the router's scores, `Routing`) and the experts of one layer.

Routing covers the families' variants: softmax scores with or without renormalising the top-k
(Mixtral, Qwen-MoE, DeepSeek-V2), sigmoid scores with a selection-only correction bias (DeepSeek-V3),
group-limited choice (experts in groups; only the best `topk_groups` groups compete; a group's score
is its best expert, or the sum of its best two for V3), and a scale on the routed weights.

`FusedMoE` stacks every expert's gate+up projection into one [E, 2I, H] tensor and the down
projections into [E, H, I] (with biases [E, 2I] and [E, H] where the model has them: GPT-OSS). A
weight format that quantizes experts (`QuantizationConfig.expert_method`: MXFP4, as GPT-OSS ships
them; a GGUF file's own blocks on CPU) keeps each expert's two projections as block-quantized modules of that format instead
(`ExpertProjection`), dequantized inside the block kernels' matmul. A forward pass sorts the
(token, expert) pairs by expert and runs, for each expert that received tokens, one matmul pair over
all of them: the Python loop is over active experts, never over tokens; on a GPU every expert runs in
one grouped Triton launch per projection (`kernels/triton_moe.py`; block-quantized experts with their
blocks stacked), which reads no counts back to the host. The gated activation is
SiLU by default (GPT-OSS: its clamped SwiGLU). Outputs are weighted by the routing weights and
summed per token.

Under tensor parallelism each rank holds every expert's share of the intermediate features (gate/up
rows, down columns); its partial output and the shared experts' (split the same way) are summed
over the ranks with one all-reduce. With expert parallelism (`tokenmill.distributed.expert_parallel`)
each rank holds whole experts and the (token, expert) pairs travel to them.

Per-expert token counts are kept (`expert_tokens`) for the routing statistics in /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed import expert_parallel, parallel_state
from tokenmill.kernels import block_quant, triton_block, triton_fused, triton_moe
from tokenmill.layers import host_placement
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.forward_context import counts_experts
from tokenmill.quantization import gguf
from tokenmill.quantization.base import LinearMethod, dense

# checkpoint names of one expert's projections -> (our parameter, shard of it)
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),  # Qwen-MoE, DeepSeek
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", 0),  # Mixtral
}


@dataclass(frozen=True)
class Routing:
    top_k: int
    renormalize: bool = False  # the top-k weights divided by their sum
    scoring: str = "softmax"  # or "sigmoid"
    num_groups: int = 1  # > 1: experts in equal groups, chosen only from the best `topk_groups`
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert's ("max") or its best two summed ("top2")
    scale: float = 1.0  # on the routed weights (DeepSeek's routed_scaling_factor)


def check_expert_counts(num_experts: int, top_k: int) -> None:
    """A model config's expert counts (0 experts: no MoE layers)."""
    if num_experts and not 0 < top_k <= num_experts:
        raise ValueError(f"model config: num_experts_per_tok must be in 1..{num_experts}, got {top_k}")


def select_experts(
    router_logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of each token's experts. `correction_bias` shifts
    the scores for choosing only; the weights are the unshifted scores."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        grouped = choice.view(choice.shape[0], routing.num_groups, -1)
        group_scores = (
            grouped.amax(dim=-1) if routing.group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
        )
        best = torch.topk(group_scores, routing.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = torch.topk(choice, routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routing.scale if routing.scale != 1.0 else weights, ids


def count_experts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `ids` name each expert. Not `torch.bincount`: on CUDA it reads the largest id back to
    size its output, a wait for the device in every MoE layer."""
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def grouped_experts(
    x: torch.Tensor, num_experts: int, run_experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, one matmul pair per active
    expert (`run_experts(rows grouped by expert, rows per expert)`)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    token_of = order // ids.shape[1]
    out = run_experts(x.index_select(0, token_of), count_experts(flat, num_experts))
    out.mul_(weights.flatten()[order].unsqueeze(1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, token_of, out)


class ExpertProjection(nn.Module):
    """One expert's projection (rows x cols) in a block-quantized weight format: the format's
    `LinearMethod` owns the storage and runs the matmul, as it does for a linear layer."""

    def __init__(self, method: LinearMethod, rows: int, cols: int, prefix: str) -> None:
        super().__init__()
        self.prefix, self.quant_method = prefix, method
        method.create_weights(self, cols, [rows], torch.get_default_dtype())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, None)


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        routing: Routing,
        hidden_size: int,
        intermediate_size: int,
        prefix: str = "",
        bias: bool = False,
        activation=silu_and_mul,
        method: LinearMethod | None = None,
    ) -> None:
        """`activation`: [n, 2I] gate and up halves -> [n, I]; `method`: the experts' weight format
        (None: dense in the default dtype)."""
        super().__init__()
        self.activation, self.method = activation, method
        self.num_experts, self.routing, self.top_k = num_experts, routing, routing.top_k
        self.prefix = prefix
        self.layer_index = int(next((p for p in prefix.split(".") if p.isdigit()), -1))  # model.layers.N.…
        size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
        self.expert_parallel = expert_parallel.enabled() and size > 1
        if self.expert_parallel:  # whole experts on their rank
            self.experts, self.columns = expert_parallel.local_experts(num_experts, prefix), slice(None)
        else:  # every expert, this rank's share of its intermediate features (all of them on one rank)
            if intermediate_size % size:
                raise ValueError(
                    f"{prefix}: expert intermediate size {intermediate_size} does not split over {size} ranks"
                )
            share = intermediate_size // size
            self.experts, self.columns = range(num_experts), slice(rank * share, (rank + 1) * share)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        local, share = len(self.experts), len(range(intermediate_size)[self.columns])
        self.share = share
        with host_placement.on_host(self.layer_index in host_placement.current().experts):  # --cpu-moe
            self._create_experts(local, share, hidden_size, bias)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def _create_experts(self, local: int, share: int, hidden_size: int, bias: bool) -> None:
        method, prefix = self.method, self.prefix
        if method is None:
            self.w13 = nn.Parameter(torch.empty(local, 2 * share, hidden_size), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(local, hidden_size, share), requires_grad=False)
        else:
            self.w13 = nn.ModuleList(
                ExpertProjection(method, 2 * share, hidden_size, f"{prefix}.{e}.gate_up_proj") for e in self.experts
            )
            self.w2 = nn.ModuleList(
                ExpertProjection(method, hidden_size, share, f"{prefix}.{e}.down_proj") for e in self.experts
            )
        self.w13_bias = nn.Parameter(torch.zeros(local, 2 * share), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(local, hidden_size), requires_grad=False) if bias else None

    def inactive_parameters(self) -> int:
        """Expert parameters a token does not use (it runs top_k of the num_experts)."""
        return (self.num_experts - self.top_k) * 3 * self.hidden_size * self.intermediate_size

    def checkpoint_keys(self) -> list[tuple[str, tuple[int, int]]]:
        """Every (parameter, (expert, shard)) the checkpoint must fill."""
        kinds = ("w13", "w2") + (("w13_bias", "w2_bias") if self.w13_bias is not None else ())
        return [(k, (e, s)) for e in range(self.num_experts) for k in kinds for s in ((0, 1) if "13" in k else (0,))]

    def weight_loader(self, kind: str, weight, shard: tuple[int | None, int]) -> None:
        """`kind` "w13" or "w2" (or their "_bias"); `shard` (expert, 0 gate / 1 up); expert None: a
        tensor of every expert. This rank keeps its experts and its share of their intermediate
        features. A quantized format takes its experts one at a time, in whatever form its method
        loads (a dense tensor to quantize, or the checkpoint's own codes)."""
        expert, part = shard
        if expert is not None and expert not in self.experts:
            return  # another rank's expert
        if kind.endswith("_bias"):
            whole = (self.intermediate_size,) if kind == "w13_bias" else (self.hidden_size,)
        else:
            whole = (
                (self.intermediate_size, self.hidden_size)
                if kind == "w13"
                else (self.hidden_size, self.intermediate_size)
            )
        if kind not in ("w13", "w2") or self.method is None:
            src = dense(weight)
            want = whole if expert is not None else (self.num_experts, *whole)
            if tuple(src.shape) != want:
                raise ValueError(f"has shape {tuple(src.shape)}, expected {want}")
        rows = slice(part * self.share, (part + 1) * self.share) if kind.startswith("w13") else slice(None)
        if kind in ("w13", "w2") and self.method is not None:
            src_rows, src_cols = (self.columns, slice(None)) if kind == "w13" else (slice(None), self.columns)
            if expert is None:  # every expert in one tensor (GGUF): each one's part of it
                if not hasattr(weight, "expert"):
                    raise ValueError(
                        "holds every expert in one tensor; a quantized expert format loads them one by one"
                    )
                for e in self.experts:
                    self.method.load(
                        getattr(self, kind)[e - self.experts.start], weight.expert(e), rows, src_rows, src_cols
                    )
                return
            module = getattr(self, kind)[expert - self.experts.start]
            self.method.load(module, weight, rows, src_rows, src_cols)
            return
        dest = getattr(self, kind).data
        if expert is None:
            dest, src = dest[:, rows], src[self.experts.start : self.experts.stop]
        else:
            dest = dest[expert - self.experts.start, rows]
        if kind == "w13":
            src = src[..., self.columns, :]
        elif kind in ("w2", "w13_bias"):
            src = src[..., self.columns]
        dest.copy_(src)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` grouped by local expert (counts[e] rows for expert e, in expert order) through their expert."""
        down_bias = self.w2_bias is not None and (self.expert_parallel or parallel_state.tp_rank() == 0)
        stacked = self._stacked() if gguf.runs_triton(rows) and triton_fused.available() else None
        if stacked is not None:
            # on the GPU: all the experts in one Triton launch per projection, no wait for the counts
            w2_bias = self.w2_bias if down_bias else None
            return triton_moe.run_experts(rows, counts, *stacked, self.activation, self.w13_bias, w2_bias)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                part = slice(start, start + n)
                gate_up = self._project(self.w13, e, rows[part])
                if self.w13_bias is not None:
                    gate_up += self.w13_bias[e]
                out[part] = self._project(self.w2, e, self.activation(gate_up))
                if down_bias:  # once over the ranks that sum their partial outputs
                    out[part] += self.w2_bias[e]
                start += n
        return out

    def _stacked(self) -> tuple | None:
        """(w13, w2) as the grouped Triton GEMM takes them: the dense stacks, or every expert's blocks
        stacked into [E, ...] tensors, made once (each expert's buffers then view its part: no second
        copy); None for a format the kernel lacks."""
        if not isinstance(self.w13, nn.ModuleList):
            return self.w13, self.w2
        if "stacked_blocks" not in vars(self):
            self.stacked_blocks = None
            if hasattr(self.method, "blocks") and triton_block.supports(self.method.blocks(self.w13[0])):
                self.stacked_blocks = tuple(_stack_blocks(self.method, list(ml)) for ml in (self.w13, self.w2))
        return self.stacked_blocks

    @staticmethod
    def _project(weights, expert: int, x: torch.Tensor) -> torch.Tensor:
        return weights[expert](x) if isinstance(weights, nn.ModuleList) else x @ weights[expert].t()

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        shared: nn.Module | None = None,
        shared_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' output, plus `shared` (always-on experts: an MLP with `partial`) times
        `shared_scale` when given. Under tensor parallelism both partial sums share one all-reduce."""
        weights, ids = select_experts(router_logits, self.routing, correction_bias)
        if counts_experts():
            counts = count_experts(ids.flatten(), self.num_experts)
            # experts on the host (--cpu-moe): counted on the device
            self.expert_tokens += counts.to(self.expert_tokens.device, non_blocking=True)
        split = parallel_state.tp_size() > 1 and not self.expert_parallel
        if self.expert_parallel:
            out = expert_parallel.dispatch_and_combine(x, weights, ids, self.experts, self.run_experts)
        else:
            out = grouped_experts(x, self.num_experts, self.run_experts, weights, ids)
        if shared is not None:
            always = shared.partial(x) if split else shared(x)
            out = out + (always if shared_scale is None else shared_scale * always)
        return parallel_state.all_reduce(out) if split else out


def _stack_blocks(method: LinearMethod, experts: list[nn.Module]) -> block_quant.Blocks:
    """The experts' blocks as one `Blocks` of [E, ...] tensors; each expert's buffers become views of it."""
    stacked = triton_block.stack([method.blocks(m) for m in experts])
    for name in ("codes", "high", "scales", "offsets", "supers"):
        if getattr(stacked, name) is not None:
            for e, m in enumerate(experts):
                setattr(m, name, getattr(stacked, name)[e])
    return stacked
