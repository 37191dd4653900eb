"""`SchedulerOutput`: what the scheduler decided for one step, as the executor sees it.

It carries only plain data (ids, token ids, block ids), never the core's `Request` objects, so it
can be sent to worker processes. The model runner keeps each request's state between steps: a
request appears once in `new_requests` with everything about it, afterwards only its changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.kv_transfer.base import KVConnectorMetadata
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has not seen before — or one whose state there a failed step left
    stale: it replaces that state (the scheduler's `step_failed`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int]  # empty with ignore_eos
    block_ids: list[list[int]]  # its block table in each KV pool
    num_computed_tokens: int  # > 0 when its prompt starts in the prefix cache
    output_token_ids: list[int] = field(default_factory=list)  # its output so far (a rebuilt state's)


@dataclass
class CachedRequestData:
    """A request the runner holds already: its new blocks and where it stands."""

    request_id: str
    new_block_ids: list[list[int]]  # per KV pool
    num_computed_tokens: int
    resumed: bool = False  # back after preemption: `new_block_ids` is its whole block table


@dataclass
class GrammarBitmask:
    """Structured-output masks for this step's sampling: row i (xgrammar's packed int32 bitmask)
    is the allowed-token mask of `request_ids[i]`."""

    request_ids: list[str]
    bitmask: torch.Tensor
    # speculating requests: (first row, rows) of their masks after the sampling rows, one per verified
    # position (after 0, 1, ..., k of its drafts)
    verify_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> new tokens this step
    finished_request_ids: set[str] = field(default_factory=set)  # finished since the last step: drop them
    preempted_request_ids: list[str] = field(default_factory=list)  # gave way this step (state kept)
    # drafted tokens to verify, per speculating request: its scheduled tokens are its next token + these
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    grammar: GrammarBitmask | None = None  # set by the engine core after scheduling
    # the most drafts each request may use after this step, which the runner's drafter proposes at its
    # end (set by the engine core after scheduling; requests not listed draft nothing)
    draft_lengths: dict[str, int] = field(default_factory=dict)
    # the KV connector's work for this step (loads before the forward, saves after), from its scheduler half
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
