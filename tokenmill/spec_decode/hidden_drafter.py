"""The drafter for modules that read the target's hidden states: EAGLE-3 (`eagle`) and MTP layers
(`mtp`). The drafter's KV at position t is computed from the target's hidden state at t (EAGLE-3: three
layers' fused by `fc`; MTP: the final one) and the embedding of token t + 1, so it is fed, every step,
each speculating request's positions whose next token is now known: a prefill chunk's, or a verify
step's accepted ones (rejected drafts never reach it). The last fed position predicts the token
after the request's newest one: the first draft; each further draft feeds the previous draft with
the drafter's own output hidden state at the next position (those positions' KV is overwritten by
the next step's feed). Drafts are the drafter's argmax (point masses for the rejection sampler).

The KV lives in the drafter's own small pool (`draft_pool`). A request it first sees after position
0 (a prefix-cache hit; or one that lost its blocks to others) starts its cache there: it attends to
the positions it has seen, with the same relative rotary positions — drafts may be worse, never wrong.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.loader import LoadedModel
from tokenmill.spec_decode.draft_pool import DraftKVPool, draft_engine_config
from tokenmill.spec_decode.drafter import Drafter, DraftStep

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Feed:
    """One request's part of the target's step."""

    tokens: list[int]  # its tokens after the step (sampled / accepted ones included)
    num_computed: int  # positions the target had computed before the step
    hidden: torch.Tensor  # the target's hidden states at the step's positions (the drafter's kind), one row each


class HiddenStateDrafter(Drafter):
    def __init__(self, module: nn.Module, target: LoadedModel, config: EngineConfig) -> None:
        """`module`: the drafter, with forward(input_ids, positions, hidden_states) -> hidden, `combine`
        (target hidden -> drafter hidden), `compute_logits`, `to_target` (draft ids -> target ids) and
        `aux` (whether it reads the target's auxiliary hidden states)."""
        self.module = module
        self.disable_by_batch_size = config.speculative.disable_by_batch_size
        loaded = dataclasses.replace(target, model=module, quantization="none")
        self.pool = DraftKVPool(loaded, draft_engine_config(config, None))
        logger.info(
            "%s drafter: %d KV blocks of %d tokens", type(module).__name__, self.pool.num_blocks, self.pool.block_size
        )

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Feed the drafter this step's hidden states of every request that may speculate (its KV must
        follow the target's), and draft for the wanting ones. Under load (more than `disable_by_batch_size`
        requests, none drafting) nothing is fed: when drafting resumes, a request's drafter cache restarts
        where the request is (only its drafts' quality drops)."""
        if not step.wanted and len(step.req_ids) > self.disable_by_batch_size:
            return {}
        source = step.model.model.aux_hidden if self.module.aux else step.hidden
        bounds = step.query_start_loc.tolist()
        feeds = {}
        for i, (rid, computed) in enumerate(zip(step.req_ids, step.num_computed)):
            s = step.requests[rid]
            if s.params.speculative:
                tokens = s.prompt_token_ids + s.output_token_ids
                feeds[rid] = Feed(tokens, int(computed), source[bounds[i] : bounds[i + 1]])
        return self.step(feeds, step.wanted)

    def finish(self, request_id: str) -> None:
        self.pool.finish(request_id)

    @torch.inference_mode()
    def step(self, feeds: dict[str, Feed], wanted: dict[str, int]) -> dict[str, list[int]]:
        """Feed the step's hidden states; up to `wanted[r]` drafts for the requests that want them."""
        rids, inputs, computed, rows = [], [], [], []
        for rid, feed in feeds.items():
            n = min(len(feed.tokens) - 1 - feed.num_computed, feed.hidden.shape[0])
            if n <= 0:
                continue
            state = self.pool.state(rid)
            local = feed.num_computed - state.start
            if 0 <= local <= len(state.tokens):
                del state.tokens[local:]  # positions past the target's (recomputed after a preemption)
            else:
                state.tokens.clear()
                state.start = feed.num_computed
            k = wanted.get(rid, 0) if feed.num_computed + n == len(feed.tokens) - 1 else 0
            if not self.pool.reserve(rid, len(state.tokens) + n + max(k - 1, 0), feeds):
                self.pool.finish(rid)
                continue
            rids.append(rid)
            inputs.append(feed.tokens[feed.num_computed + 1 : feed.num_computed + 1 + n])
            computed.append(len(state.tokens))
            rows.append(self.module.combine(feed.hidden[:n]))
        if not rids:
            return {}
        hidden = self.pool.forward(rids, inputs, computed, rows)
        for rid, fed in zip(rids, inputs):
            self.pool.states[rid].tokens.extend(fed)
        drafts: dict[str, list[int]] = {}
        live = [
            i
            for i, rid in enumerate(rids)
            if wanted.get(rid, 0) and feeds[rid].num_computed + len(inputs[i]) == len(feeds[rid].tokens) - 1
        ]
        hidden = hidden[live] if live else hidden[:0]
        draft_rids = [rids[i] for i in live]
        for j in range(max((wanted[r] for r in draft_rids), default=0)):
            if j:
                hidden = self.pool.forward(
                    draft_rids,
                    [[drafts[r][-1]] for r in draft_rids],
                    [len(self.pool.states[r].tokens) + j - 1 for r in draft_rids],
                    list(hidden.unsqueeze(1)),
                )
            tokens = self.module.to_target(self.module.compute_logits(hidden).argmax(dim=-1)).tolist()
            for rid, token in zip(draft_rids, tokens):
                drafts.setdefault(rid, []).append(token)
            keep = [i for i, r in enumerate(draft_rids) if wanted[r] > j + 1]
            draft_rids, hidden = [draft_rids[i] for i in keep], hidden[keep]
        return drafts
