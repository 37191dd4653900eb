"""Draft-model proposer: a smaller model with the target's tokenizer drafts greedily, k tokens in k
forward passes over its own paged KV cache.

The draft runs as a `ModelRunner` of its own (its model, attention backend and KV cache) inside the
target's model runner, so it drafts during the step, right after the target sampled. Its blocks are
kept here, per request: a block table and the tokens whose KV is in it. Before drafting, the cached
tokens are compared with the request's tokens now: the KV of every token up to the first difference
(a rejected draft) is kept, the rest is recomputed — so rollback needs no bookkeeping, and a
request's first draft step prefills its whole prompt into the draft cache. Drafts are the draft's
argmax for greedy and constrained requests (a point mass); a sampling request's drafts are drawn
from the draft's distribution under its own settings (temperature, top-k/p, min-p) with its own
generator, and those distributions go to the rejection sampler (accept with min(1, p/q)); constrained
requests keep argmax drafts because cutting drafts at the grammar would bias a sampled q. Requests
that finish give their blocks back;
when the pool runs short, requests that are not drafting this step lose theirs (oldest first).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.rejection_sampler import target_probs
from tokenmill.worker.sampler import random_sample

logger = logging.getLogger(__name__)

DRAFT_CONTEXT_TOKENS = 4096  # per drafting request, when sizing the draft's pool (max_model_len if smaller)
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


@dataclasses.dataclass
class DraftState:
    blocks: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # whose KV the blocks hold, in order


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int) -> None:
        from tokenmill.executor.abstract import load_configured_model, size_kv_cache
        from tokenmill.worker.model_runner import ModelRunner

        spec = config.speculative
        context = min(config.scheduler.max_model_len or DRAFT_CONTEXT_TOKENS, DRAFT_CONTEXT_TOKENS)
        blocks = spec.disable_by_batch_size * -(-context // config.cache.block_size) + spec.disable_by_batch_size
        draft_config = dataclasses.replace(
            config, model=spec.model, speculative=None, parallel=ParallelConfig(),
            cache=CacheConfig(block_size=config.cache.block_size, num_blocks=blocks, enable_prefix_caching=False,
                              cache_dtype=config.cache.cache_dtype))
        loaded = load_configured_model(draft_config)
        if loaded.config.vocab_size > target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({loaded.config.vocab_size}) is "
                             f"larger than the target's ({target_vocab_size}); it must share the target's tokenizer")
        self.runner = ModelRunner(loaded, draft_config)
        kv = size_kv_cache(draft_config, self.runner.kv_cache_specs())
        self.runner.initialize_kv_cache(kv)
        self.runner.warm_up()
        self.block_size, self.num_pools = kv.block_size, len(kv.pool_blocks)
        self.target_vocab_size = target_vocab_size
        self.free = list(range(kv.num_blocks))
        self.states: OrderedDict[str, DraftState] = OrderedDict()  # least recently drafted first
        logger.info("draft model %s: %d KV blocks of %d tokens", spec.model, kv.num_blocks, kv.block_size)

    def finish(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free.extend(state.blocks)

    def _reserve(self, request_id: str, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` positions of a request, taking them from idle requests if needed."""
        state = self.states[request_id]
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        for victim in [r for r in self.states if r not in keep]:
            if len(self.free) >= need:
                break
            self.finish(victim)
        if len(self.free) < need:
            return False
        if need > 0:
            state.blocks.extend(self.free[-need:])
            del self.free[-need:]
        return True

    @torch.inference_mode()
    def propose(self, wanted: dict[str, DraftRequest]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Up to k drafts for each request, and for the requests whose drafts were sampled the
        distributions they were drawn from ([drafts, target vocabulary])."""
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        pending: dict[str, list[int]] = {}  # tokens each request feeds the draft next
        for rid, want in wanted.items():
            tokens, k, left = want.tokens, want.k, want.left
            state = self.states.setdefault(rid, DraftState())
            self.states.move_to_end(rid)
            same = 0
            for a, b in zip(state.tokens, tokens[:-1]):  # the newest token is always fed
                if a != b:
                    break
                same += 1
            del state.tokens[same:]
            if len(tokens) - same > CATCH_UP_PER_TOKEN_LEFT * left:
                continue
            if self._reserve(rid, len(tokens) + k - 1, set(wanted)):
                pending[rid] = tokens[same:]
                drafts[rid] = []
        for _ in range(max((w.k for w in wanted.values()), default=0)):
            rids = [r for r in pending if len(drafts[r]) < wanted[r].k]
            if not rids:
                break
            logits = self._forward(rids, [pending[r] for r in rids])
            for row, rid in enumerate(rids):
                token, q = self._choose(logits[row], wanted[rid])
                if q is not None:
                    probs.setdefault(rid, []).append(q)
                self.states[rid].tokens.extend(pending[rid])
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

    def _forward(self, rids: list[str], inputs: list[list[int]]) -> torch.Tensor:
        """One draft forward of each request's `inputs` after its cached tokens -> the logits after
        each one's last input, [requests, V_draft] in `rids` order."""
        num_new = [len(x) for x in inputs]
        num_computed = [len(self.states[r].tokens) for r in rids]
        order = sorted(range(len(rids)), key=lambda i: num_new[i] != 1)  # decodes first, as the runner lays out
        ids = [t for i in order for t in inputs[i]]
        hidden, common = self.runner.forward(
            np.asarray(ids, dtype=np.int64), np.asarray([num_new[i] for i in order], dtype=np.int64),
            np.asarray([num_computed[i] for i in order], dtype=np.int64),
            [[self.states[rids[i]].blocks] * self.num_pools for i in order])
        last = torch.from_numpy(common.query_start_loc[1:] - 1).to(hidden.device)
        logits = self.runner.model.compute_logits(hidden[last])
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]
