"""The drafter seam: the model runner holds one `Drafter` (`make_drafter`, from the speculative config;
None without speculation) and, at the end of each step — after it sampled and verified, so the request
states hold every token the step produced — hands it the step (`DraftStep`). The drafter returns up to
`wanted[r]` drafts for each request the core asked drafts for; they travel back in
`ModelRunnerOutput.draft_token_ids`, and the core trims them to what the batch can verify (and, for a
structured request, to what its grammar accepts). `finish` forgets a request that ended.

A drafter may use any part of the step: the request's tokens (n-gram lookup), the target's final hidden
state of the row each newest token was predicted from (Medusa heads), a model of its own over its own
paged KV pool (a draft model), or the target's hidden states of every position the step computed, fed
into its own KV so that it follows the target (EAGLE-3, MTP: `hidden_drafter`). The last kind is what
block drafters need too (DFlash, DSpark: `block_drafter`): `step.model.model.aux_hidden` holds the
hidden states of several target layers (a target built with `aux_layers`; a drafter says which it
reads), and they propose all of a request's k tokens in one forward (a non-causal block over k mask
positions) instead of k sequential ones — the interface only asks for up to k tokens per request. A drafter that samples its
drafts from a distribution q leaves q in the request state (`draft`) for the rejection sampler.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.loader import LoadedModel


@dataclasses.dataclass
class DraftStep:
    """The target's step as a drafter sees it, after sampling and verification."""

    wanted: dict[str, int]  # requests to draft for -> the most drafts each may use (they sampled this step)
    req_ids: list[str]  # the step's requests in batch order (decodes first)
    requests: dict[str, object]  # the runner's request states (`CachedRequestState`): tokens, params, generator
    num_computed: np.ndarray  # [B] positions each of `req_ids` had computed before the step
    query_start_loc: np.ndarray  # [B + 1] each one's first row in `hidden`
    hidden: torch.Tensor  # the target's final hidden state of every row of the step
    last_rows: dict[str, int]  # the row each sampling request's newest token was predicted from
    model: nn.Module  # the target: `compute_logits`, and `model.aux_hidden` when built with `aux_layers`


class Drafter(ABC):
    @abstractmethod
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Up to `step.wanted[r]` drafted tokens to follow each wanting request's newest token (a request
        may be left out: it drafts nothing this time)."""

    def finish(self, request_id: str) -> None:
        """Forget a request that ended (drafters that keep state per request: their KV blocks)."""


def make_drafter(config: EngineConfig, target: LoadedModel) -> Drafter:
    """The drafter `config.speculative` asks for, for this target (model files loaded only when used)."""
    spec = config.speculative
    if spec.method == "ngram":
        from tokenmill.spec_decode.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "medusa":
        from tokenmill.spec_decode.medusa import MedusaDrafter

        return MedusaDrafter(spec.model, target)
    if spec.method == "draft_model":
        from tokenmill.spec_decode.draft_model import DraftModelDrafter

        return DraftModelDrafter(config, target.config.vocab_size)
    if spec.method in ("dflash", "dspark"):
        from tokenmill.spec_decode.block_drafter import BlockDrafter
        from tokenmill.spec_decode.dflash import load_dflash
        from tokenmill.spec_decode.dspark import DSparkModule

        return BlockDrafter(load_dflash(spec.model, target, DSparkModule if spec.method == "dspark" else None), config)
    from tokenmill.spec_decode.hidden_drafter import HiddenStateDrafter

    if spec.method == "eagle3":
        from tokenmill.spec_decode.eagle import load_eagle3

        return HiddenStateDrafter(load_eagle3(spec.model, target), target, config)
    if spec.method == "mtp":
        from tokenmill.spec_decode.mtp import load_mtp

        return HiddenStateDrafter(load_mtp(target), target, config)
    raise ValueError(f"speculative_config.method {spec.method!r} has no drafter")
