"""The LoRA kernel (csrc/lora.cpp) against the torch path: random segments of a flat batch, fused
layers' shards, ranks below the slots' rank, a slot no segment uses, and base-model rows left exactly
as they were. test_kernels' portable-build test runs this module again built for plain x86-64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels import lora as lora_kernel
from tokenmill.layers.forward_context import ForwardContext, set_forward_context
from tokenmill.lora.manager import LoRABatch
from tokenmill.lora.weights import LoRAWeights

pytestmark = pytest.mark.skipif(lora_kernel.cpu_kernels() is None, reason="no C++ kernels here")


def random_weights(g: torch.Generator, in_features: int, out_sizes: list[int], ranks: dict[int, int]) -> LoRAWeights:
    """A layer's LoRA slots (4, rank 8) with random factors of rank ranks[slot] in the given slots."""
    weights = LoRAWeights(in_features, out_sizes, 4, 8, torch.float32, "cpu")
    for slot, r in ranks.items():
        for shard, size in enumerate(out_sizes):
            weights.set(slot, shard, torch.randn(r, in_features, generator=g), torch.randn(size, r, generator=g))
    return weights


def batch_of(row_slots: np.ndarray, scaling: dict[int, float]) -> LoRABatch:
    """What `LoRAManager.batch` describes for rows running these slots (-1: the base model)."""
    starts = np.flatnonzero(np.diff(row_slots, prepend=-2))
    groups = [
        (s, torch.from_numpy(np.flatnonzero(row_slots == s)), scaling[s]) for s in np.unique(row_slots[row_slots >= 0])
    ]
    segments = lora_kernel.Segments(
        torch.from_numpy(np.append(starts, len(row_slots))),
        torch.from_numpy(row_slots[starts]),
        torch.tensor([scaling.get(int(s), 0.0) for s in row_slots[starts]], dtype=torch.float32),
    )
    return LoRABatch(groups, segments)


def torch_path(weights: LoRAWeights, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """The torch path's result (float64 inputs, so `add_to` takes it), as float32."""
    weights.a, weights.b = weights.a.double(), weights.b.double()
    try:
        with set_forward_context(ForwardContext({}, batch)):
            return weights.add_to(x.double(), out.double()).float()
    finally:
        weights.a, weights.b = weights.a.float(), weights.b.float()


@pytest.mark.parametrize("out_sizes", [[70], [48, 16, 16], [33, 33]])
def test_lora_kernel_matches_the_torch_path(out_sizes):
    g = torch.Generator().manual_seed(sum(out_sizes))
    rng = np.random.default_rng(len(out_sizes))
    weights = random_weights(g, 45, out_sizes, {0: 8, 2: 5, 3: 1})  # slot 1 unused
    # runs of random lengths on random slots, the base model's included, some slots on several runs
    row_slots = np.repeat(rng.choice([-1, 0, 2, 3], size=12), rng.integers(1, 6, size=12)).astype(np.int64)
    batch = batch_of(row_slots, {0: 2.0, 2: 0.5, 3: 1.25})
    x = torch.randn(len(row_slots), 45, generator=g)
    base = torch.randn(len(row_slots), sum(out_sizes), generator=g)
    expected = torch_path(weights, x, base, batch)
    with set_forward_context(ForwardContext({}, batch)):
        got = weights.add_to(x, base.clone())
    base_rows = torch.from_numpy(np.flatnonzero(row_slots < 0))
    assert len(base_rows) and torch.equal(got[base_rows], base[base_rows])
    # float32 sums in another order than torch's GEMM: within rounding of the largest values
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    assert not torch.equal(got, base)


def test_lora_kernel_edges():
    """No rows, only base-model rows, and segments that do not cover the batch (a clear error)."""
    weights = random_weights(torch.Generator().manual_seed(0), 16, [8], {0: 8})
    for row_slots in (np.zeros(0, dtype=np.int64), np.full(3, -1, dtype=np.int64)):
        batch = batch_of(row_slots, {0: 1.0})
        base = torch.randn(len(row_slots), 8)
        with set_forward_context(ForwardContext({}, batch)):
            assert torch.equal(weights.add_to(torch.randn(len(row_slots), 16), base.clone()), base)
    short = batch_of(np.zeros(2, dtype=np.int64), {0: 1.0})
    with set_forward_context(ForwardContext({}, short)), pytest.raises(RuntimeError, match="segments must cover"):
        weights.add_to(torch.randn(3, 16), torch.zeros(3, 8))
