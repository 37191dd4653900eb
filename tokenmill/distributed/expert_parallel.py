"""Expert parallelism (`--enable-expert-parallel`): a mixture-of-experts layer's experts are placed
across the tensor-parallel ranks instead of split inside each expert. With E experts on N ranks,
rank r holds experts [r * E/N, (r + 1) * E/N) whole; attention and dense MLPs stay tensor-parallel.

The hidden states entering an MoE layer are the same on every rank (the attention's all-reduce made
them so), and so is the router's choice. Each rank is the home of a contiguous slice of the step's
tokens: it sends each (token, expert) pair of its slice to the rank owning that expert with one
`all_to_all_single`, runs the pairs it received through its experts, sends the outputs back with a
second `all_to_all_single`, weights and sums them per token (in expert order, as one process does),
and an `all_gather` of the slices gives every rank the layer's whole output. gloo runs all three on
CPU (uneven split sizes included), NCCL on CUDA. Every rank knows every pair's home and owner from
the shared routing, so the split sizes need no exchange.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from tokenmill.distributed import parallel_state

_enabled = False


@contextlib.contextmanager
def placement(enabled: bool):
    """Layers built inside place experts across ranks (`enabled`) or split each expert (not)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    return _enabled


def local_experts(num_experts: int, prefix: str) -> range:
    """The experts this rank holds under expert parallelism."""
    size = parallel_state.tp_size()
    if num_experts % size:
        raise ValueError(
            f"{prefix}: {num_experts} experts do not split over {size} ranks "
            "(--enable-expert-parallel needs a multiple of --tensor-parallel-size)"
        )
    per_rank = num_experts // size
    return range(parallel_state.tp_rank() * per_rank, (parallel_state.tp_rank() + 1) * per_rank)


def rank_tokens(expert_tokens: dict[int, list[int]], size: int) -> list[int]:
    """(token, expert) pairs routed to each rank's experts, over every MoE layer."""
    totals = [0] * size
    for counts in expert_tokens.values():
        per_rank = len(counts) // size
        for rank in range(size):
            totals[rank] += sum(counts[rank * per_rank : (rank + 1) * per_rank])
    return totals


def check_has_experts(model_config) -> None:
    """`--enable-expert-parallel` needs a model with mixture-of-experts layers."""
    if not getattr(model_config, "num_experts", 0):
        raise ValueError(
            f"--enable-expert-parallel: {model_config.architecture} is a dense model "
            "(no mixture-of-experts layers to place across ranks)"
        )


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
    start = time.perf_counter()
    out = x.new_empty(sum(receive), x.shape[1])
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=parallel_state.tp_group())
    parallel_state.stats.add("all_to_all", start, x.numel() * x.element_size())
    return out


def _gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's `x` (rank j's has sizes[j] rows) stacked in rank order."""
    start = time.perf_counter()
    padded = x.new_zeros(max(sizes), x.shape[1])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=parallel_state.tp_group())
    parallel_state.stats.add("all_gather", start, padded.numel() * padded.element_size())
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def dispatch_and_combine(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: range, run_experts
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token, this rank running only
    `experts` (`run_experts(rows grouped by local expert, rows per local expert)`)."""
    size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    tokens, top_k = ids.shape
    bounds = [tokens * j // size for j in range(size + 1)]
    flat = ids.flatten()
    token_of = torch.arange(flat.numel(), device=flat.device) // top_k
    home = torch.bucketize(token_of, torch.tensor(bounds[1:-1], device=flat.device), right=True)
    owner = flat // len(experts)
    order = torch.argsort(home * (len(experts) * size) + flat, stable=True)  # by home rank, then expert
    pairs = torch.bincount(home * size + owner, minlength=size * size).view(size, size).tolist()  # [home][owner]
    sent = order[home[order] == rank]  # this rank's pairs, by expert (so by owner)
    received = order[owner[order] == rank]  # the pairs it runs, by home then expert
    rows = _all_to_all(x.index_select(0, token_of[sent]), pairs[rank], [pairs[s][rank] for s in range(size)])
    local = flat[received] - experts.start
    by_expert = torch.argsort(local, stable=True)
    out = torch.empty_like(rows)
    out[by_expert] = run_experts(rows[by_expert], torch.bincount(local, minlength=len(experts)))
    back = _all_to_all(out, [pairs[s][rank] for s in range(size)], pairs[rank])
    back.mul_(weights.flatten()[sent].unsqueeze(1).to(back.dtype))
    mine = x.new_zeros(bounds[rank + 1] - bounds[rank], x.shape[1]).index_add_(0, token_of[sent] - bounds[rank], back)
    return _gather_rows(mine, [bounds[j + 1] - bounds[j] for j in range(size)])
