"""One step's flat batch, described once by the model runner. Each attention backend's
`build_metadata` turns this into what its kernels need; nothing here is computed twice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Requests with exactly one new token (decodes) come first in the batch."""

    num_decodes: int
    query_start_loc: np.ndarray  # [B + 1] offset of each request's first new token in the flat batch
    num_computed_tokens: np.ndarray  # [B] tokens already in the KV cache
    seq_lens: np.ndarray  # [B] cached + new tokens
    block_table: np.ndarray  # [B, max_blocks] int64, zero-padded
    slot_mapping: torch.Tensor  # [T] long, on the device: block * block_size + offset of each new token
    block_size: int
    device: torch.device
    # the step's one copy to the device (`layers.paged_forward.StepInputs.stage`): int arrays in, device
    # tensors out, filled when the step's inputs go up; None: a backend uploads its metadata itself
    stage: Callable[..., list[torch.Tensor]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


def build_common_metadata(
    num_new: np.ndarray, num_computed: np.ndarray, block_ids: list[list[int]], block_size: int, device: torch.device
) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """The step's description and the position of every new token. `num_new` / `num_computed` are
    int64 arrays per request, decodes (num_new == 1) first."""
    num_reqs = len(num_new)
    is_decode = num_new == 1
    num_decodes = int(np.argmin(is_decode)) if not is_decode.all() else num_reqs
    if is_decode[num_decodes:].any():
        raise ValueError("attention metadata: single-token requests must come first in the batch")
    if num_decodes == num_reqs:  # decodes only (most steps of a decode): token i is request i's, after its cache
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int64)
        req_of_token, positions = query_start_loc[:-1], num_computed.astype(np.int64)
    else:
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        req_of_token = np.repeat(np.arange(num_reqs), num_new)
        positions = np.arange(int(query_start_loc[-1])) - query_start_loc[req_of_token] + num_computed[req_of_token]

    table = np.zeros((num_reqs, max(len(b) for b in block_ids)), dtype=np.int64)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = blocks
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    common = CommonAttentionMetadata(
        num_decodes,
        query_start_loc,
        num_computed,
        num_computed + num_new,
        table,
        torch.from_numpy(slots).to(device),
        block_size,
        device,
    )
    return common, positions
