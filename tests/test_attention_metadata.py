"""The step's description (`build_common_metadata`): a step of decodes only takes a path of its own (token
i is request i's, at its cached length), which must describe the decodes exactly as the general path does
when a prompt chunk follows them."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.metadata import build_common_metadata


def test_a_step_of_decodes_only_is_described_as_the_decodes_of_a_mixed_step():
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    for _ in range(20):
        n = int(rng.integers(1, 6))
        computed = rng.integers(0, 100, size=n)  # the runner's int64 counts
        blocks = [rng.permutation(64)[: c // 16 + 1].tolist() for c in computed]
        alone, positions = build_common_metadata(np.ones(n, dtype=np.int64), computed, blocks, 16, cpu)
        mixed, mixed_positions = build_common_metadata(
            np.array([1] * n + [3]), np.append(computed, 0), [*blocks, [63]], 16, cpu
        )
        assert alone.num_decodes == mixed.num_decodes == n
        assert alone.query_start_loc.tolist() == mixed.query_start_loc[: n + 1].tolist()
        assert positions.tolist() == mixed_positions[:n].tolist() == computed.tolist()
        assert alone.slot_mapping.tolist() == mixed.slot_mapping[:n].tolist()
        assert alone.seq_lens.tolist() == mixed.seq_lens[:n].tolist()
        assert (alone.block_table == mixed.block_table[:n, : alone.block_table.shape[1]]).all()
        assert positions.dtype == alone.query_start_loc.dtype == np.int64
        positions += 1  # the step's own array: the runner's counts stay as they were
        assert positions.tolist() != computed.tolist()
