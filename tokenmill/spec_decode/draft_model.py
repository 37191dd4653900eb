"""Draft-model drafter: a smaller model with the target's tokenizer drafts greedily, k tokens in k
forward passes over its own paged KV cache.

The draft runs over its own KV pool (its model, attention backend and cache: `draft_pool`) inside the
target's model runner, so it drafts during the step, right after the target sampled. Its blocks are
kept here, per request: a block table and the tokens whose KV is in it. Before drafting, the cached
tokens are compared with the request's tokens now: the KV of every token up to the first difference
(a rejected draft) is kept, the rest is recomputed — so rollback needs no bookkeeping, and a
request's first draft step prefills its whole prompt into the draft cache. Drafts are the draft's
argmax for greedy and constrained requests (a point mass); a sampling request's drafts are drawn
from the draft's distribution under its own settings (temperature, top-k/p, min-p) with its own
generator, and those distributions go to the rejection sampler (accept with min(1, p/q)); constrained
requests keep argmax drafts because cutting drafts at the grammar would bias a sampled q. The KV
pool and its per-request blocks are `tokenmill.spec_decode.draft_pool`'s.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from tokenmill.config import EngineConfig
from tokenmill.loader import load_configured_model
from tokenmill.sample.rejection_sampler import target_probs
from tokenmill.sample.sampler import random_sample
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_pool import DraftKVPool, draft_engine_config
from tokenmill.spec_decode.drafter import Drafter, DraftStep

logger = logging.getLogger(__name__)

# a request whose draft cache lags by more tokens than this many per token it has left to generate is
# not drafted for: on CPU a prefilled token costs ~1/5 of a decode step of the draft, so catching up
# on a long prompt near the end of an output costs more than the drafts can save
CATCH_UP_PER_TOKEN_LEFT = 8


@dataclasses.dataclass
class DraftRequest:
    """What one request asks of the draft this step."""

    tokens: list[int]  # its tokens so far
    k: int  # drafts wanted
    left: int  # tokens it may still generate
    params: SamplingParams | None = None  # sampling settings: drafts sampled (None or greedy: argmax)
    generator: torch.Generator | None = None


class DraftModelDrafter(Drafter):
    def __init__(self, config: EngineConfig, target_vocab_size: int) -> None:
        draft_config = draft_engine_config(config, config.speculative.model)
        loaded = load_configured_model(draft_config)
        if loaded.config.vocab_size > target_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({loaded.config.vocab_size}) is "
                f"larger than the target's ({target_vocab_size}); it must share the target's tokenizer"
            )
        self.pool = DraftKVPool(loaded, draft_config)
        self.pool.warm_up()
        self.target_vocab_size = target_vocab_size
        logger.info(
            "draft model %s: %d KV blocks of %d tokens", draft_config.model, self.pool.num_blocks, self.pool.block_size
        )

    def finish(self, request_id: str) -> None:
        self.pool.finish(request_id)

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Sampled drafts unless a request is greedy or constrained; a sampled one's distributions are
        kept in its request state for the verify step of these drafts."""
        if not step.wanted:
            return {}
        asks = {}
        for rid, k in step.wanted.items():
            s = step.requests[rid]
            s.draft = None
            left = (s.params.max_tokens or 1 << 30) - len(s.output_token_ids)
            constrained = s.params.structured_output is not None
            asks[rid] = DraftRequest(
                s.prompt_token_ids + s.output_token_ids, k, left, None if constrained else s.params, s.generator
            )
        drafts, probs = self.draft(asks)
        for rid, q in probs.items():
            step.requests[rid].draft = (drafts[rid], q)
        return drafts

    @torch.inference_mode()
    def draft(self, wanted: dict[str, DraftRequest]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Up to k drafts for each request, and for the requests whose drafts were sampled the
        distributions they were drawn from ([drafts, target vocabulary])."""
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        pending: dict[str, list[int]] = {}  # tokens each request feeds the draft next
        for rid, want in wanted.items():
            tokens, k, left = want.tokens, want.k, want.left
            state = self.pool.state(rid)
            same = 0
            for a, b in zip(state.tokens, tokens[:-1]):  # the newest token is always fed
                if a != b:
                    break
                same += 1
            del state.tokens[same:]
            if len(tokens) - same > CATCH_UP_PER_TOKEN_LEFT * left:
                continue
            if self.pool.reserve(rid, len(tokens) + k - 1, set(wanted)):
                pending[rid] = tokens[same:]
                drafts[rid] = []
        for _ in range(max((w.k for w in wanted.values()), default=0)):
            rids = [r for r in pending if len(drafts[r]) < wanted[r].k]
            if not rids:
                break
            states = [self.pool.states[r] for r in rids]
            hidden = self.pool.forward(rids, [pending[r] for r in rids], [len(s.tokens) for s in states])
            logits = self.pool.model.compute_logits(hidden)
            for row, (rid, state) in enumerate(zip(rids, states)):
                token, q = self._choose(logits[row], wanted[rid])
                if q is not None:
                    probs.setdefault(rid, []).append(q)
                state.tokens.extend(pending[rid])
                drafts[rid].append(token)
                pending[rid] = [token]
        return drafts, {r: torch.stack(q) for r, q in probs.items()}

    def _choose(self, logits: torch.Tensor, want: DraftRequest) -> tuple[int, torch.Tensor | None]:
        """The next draft from the draft's logits [V_draft]: argmax, or drawn from q (returned, padded
        to the target's vocabulary) for a sampling request."""
        if want.params is None or want.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits.float().unsqueeze(0), want.params)
        q = F.pad(q, (0, self.target_vocab_size - q.shape[1]))
        token = random_sample(q.clone(), {0: want.generator} if want.generator is not None else {})
        return int(token), q[0]
