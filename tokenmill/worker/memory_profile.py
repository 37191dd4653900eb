"""The KV pool's size from the device's memory (`--gpu-memory-utilization`), as vLLM's GPU worker does it.

The engine may use `utilization * total` bytes of the device. What it needs besides the KV cache is
measured, not estimated: the weights and everything else already resident (CUDA context, cuBLAS
workspaces, other processes) are what the device reports in use, and the activations are the peak the
allocator saw during one profiling step at the largest batch the scheduler can form (every token of
`max_num_batched_tokens`, spread over up to `max_num_seqs` requests that all sample). The KV pool gets
the rest. The device queries sit behind `DeviceMemory`, so the arithmetic is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROFILE_ID = "__profile__"


class DeviceMemory:
    """The queries of one CUDA device's memory (a test passes its own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def settle(self) -> None:
        """Wait for the device's work and hand the allocator's unused cached blocks back."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass
class MemoryProfile:
    total: int  # the device's bytes
    in_use: int  # bytes in use on the device after the profile step (weights, context, other processes)
    allocated: int  # of which torch tensors still held (the weights, ...)
    peak: int  # the most torch held during the profile step
    scratch: int  # bytes of the throwaway KV cache the profile step ran on (inside `peak`)

    def kv_cache_bytes(self, utilization: float) -> int:
        """What `utilization` of the device leaves for the KV pool: the budget less what is in use
        outside torch's tensors, and less torch's peak (weights + activations) without the scratch cache."""
        non_torch = self.in_use - self.allocated
        return int(utilization * self.total) - non_torch - (self.peak - self.scratch)


def measure(memory: DeviceMemory, run_profile_step: Callable[[], int]) -> MemoryProfile:
    """Run `run_profile_step` (it returns the bytes of any scratch KV cache it allocated) between the
    device's memory readings."""
    memory.settle()
    memory.reset_peak()
    scratch = run_profile_step()
    memory.settle()
    free, total = memory.free_and_total()
    return MemoryProfile(total, total - free, memory.allocated(), memory.peak_allocated(), scratch)


def kv_cache_budget(utilization: float, profile: MemoryProfile) -> int:
    """The KV pool's bytes, or a ValueError saying what took the memory."""
    budget = profile.kv_cache_bytes(utilization)
    gib = 2**30
    logger.info(
        "memory profile: %.2f GiB device, %.2f GiB in use outside tensors, %.2f GiB peak of tensors "
        "(weights + a step's activations) -> %.2f GiB for the KV cache at gpu_memory_utilization %.2f",
        profile.total / gib,
        (profile.in_use - profile.allocated) / gib,
        (profile.peak - profile.scratch) / gib,
        budget / gib,
        utilization,
    )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {utilization * profile.total / gib:.2f} GiB, and "
            f"the weights, the largest step's activations and the memory in use outside them take "
            f"{(utilization * profile.total - budget) / gib:.2f} GiB: nothing is left for the KV cache "
            "(raise --gpu-memory-utilization, or lower --max-num-batched-tokens / --max-num-seqs)"
        )
    return budget


def profile_steps(
    num_tokens: int, num_reqs: int, block_size: int, pools: int, max_len: int
) -> tuple[list[SchedulerOutput], int]:
    """The largest step (`num_tokens` prompt tokens over `num_reqs` requests, more if one would pass
    `max_len`, each sampling one token), the step that drops them, and how many KV blocks the first
    writes (its blocks are 1..n-1: block 0 is left alone)."""
    num_reqs = max(1, min(num_reqs, num_tokens), -(-num_tokens // max_len))
    sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    new, next_block = [], 1
    for i, n in enumerate(sizes):
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        new.append(NewRequestData(f"{PROFILE_ID}{i}", [0] * n, params, set(), [blocks] * pools, 0))
    step = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in new})
    return [step, SchedulerOutput(finished_request_ids={r.request_id for r in new})], next_block


def run_profile_step(runner, block_size: int, num_tokens: int, num_reqs: int, max_len: int) -> int:
    """Run the largest step on `runner` (a `PagedForward` with `execute`) over a throwaway KV cache just
    big enough for it, then drop that cache; returns its bytes."""
    from tokenmill.attention.kv_spec import make_kv_cache_config
    from tokenmill.config import CacheConfig

    specs = runner.kv_cache_specs()
    pools = len({spec.sliding_window for spec in specs.values()})
    steps, blocks = profile_steps(num_tokens, num_reqs, block_size, pools, max_len)
    scratch = make_kv_cache_config(specs, CacheConfig(block_size=block_size, num_blocks=blocks))
    runner.initialize_kv_cache(scratch)
    for step in steps:
        runner.execute(step)
    runner.release_kv_cache()
    return scratch.total_bytes
