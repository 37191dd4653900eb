"""The drafter for block drafters (DFlash, DSpark: `dflash`, `dspark`): each request's k drafts come
from one forward of a block [newest token, mask x k] over the request's context.

A position's context (each drafter layer's key and value) depends only on the target's hidden states
there, so it is computed once, when the target's step computed that position, and kept per request
(`ContextCache`: dense, grown by doubling). Every step it is fed each speculating request's positions
whose next token is now known — a prefill chunk's, a verify step's accepted ones (rejected drafts
never reach it); the block of a request that wants drafts then starts at its newest token, whose
context is not known yet. A request first seen after position 0 (a prefix-cache hit, or one whose
cache was dropped) starts its context there: drafts may be worse, never wrong. The caches of all
requests together hold at most `disable_by_batch_size` x DRAFT_CONTEXT_TOKENS positions (least
recently used requests dropped first; a longer request keeps its latest positions).

Drafts are the argmax of each block row through the target's LM head (point masses for the rejection
sampler: greedy output is the target's, sampling keeps its distribution). `DSparkModule` drafts its
rows sequentially from the block and trims them by confidence (`dspark`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch

from tokenmill.config import EngineConfig
from tokenmill.spec_decode.draft_pool import DRAFT_CONTEXT_TOKENS
from tokenmill.spec_decode.drafter import Drafter, DraftStep


@dataclasses.dataclass
class ContextCache:
    kv: torch.Tensor  # [layers, 2, capacity, kv_heads, head_dim]
    start: int = 0  # the request's position of row 0
    length: int = 0  # rows filled

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0, : self.length], layer[1, : self.length]) for layer in self.kv]

    def append(self, rows: list[tuple[torch.Tensor, torch.Tensor]], most: int) -> None:
        """Add the keys and values of the next positions, keeping at most the latest `most`."""
        n = rows[0][0].shape[0]
        if n > most:
            rows, self.start, self.length, n = (
                [(k[-most:], v[-most:]) for k, v in rows],
                self.start + self.length + n - most,
                0,
                most,
            )
        elif self.length + n > most:
            drop = self.length + n - most
            self.kv[:, :, : self.length - drop] = self.kv[:, :, drop : self.length].clone()
            self.start, self.length = self.start + drop, self.length - drop
        if self.length + n > self.kv.shape[2]:
            shape = list(self.kv.shape)
            shape[2] = max(2 * shape[2], self.length + n)
            grown = self.kv.new_empty(shape)
            grown[:, :, : self.length] = self.kv[:, :, : self.length]
            self.kv = grown
        for i, (k, v) in enumerate(rows):
            self.kv[i, 0, self.length : self.length + n] = k
            self.kv[i, 1, self.length : self.length + n] = v
        self.length += n


@dataclasses.dataclass
class BlockStep:
    """What a block module reads to turn its block rows into drafts: the target's heads, the load."""

    logits: Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> the target LM head's logits
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> the drafter's input embeddings
    num_requests: int  # in the step (the batch's load)
    min_confidence: float  # dspark: `SpeculativeConfig`'s
    compute_bound_tokens: int


class BlockDrafter(Drafter):
    def __init__(self, module, config: EngineConfig) -> None:
        """`module`: a `DFlashModule` (or `DSparkModule`) on the target's device and dtype."""
        spec = config.speculative
        self.module, self.spec = module, spec
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.most_per_request = min(config.scheduler.max_model_len or DRAFT_CONTEXT_TOKENS, DRAFT_CONTEXT_TOKENS)
        self.budget = spec.disable_by_batch_size * self.most_per_request
        self.caches: OrderedDict[str, ContextCache] = OrderedDict()  # least recently used first

    def finish(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def _cache(self, rid: str, position: int, like: torch.Tensor) -> ContextCache:
        """The request's cache, cut back to `position` (rows past it were recomputed after a
        preemption) or started there when it does not reach it."""
        cache = self.caches.pop(rid, None)
        if cache is None or not 0 <= position - cache.start <= cache.length:
            c = self.module.config
            kv = like.new_empty((c.num_hidden_layers, 2, 64, c.num_key_value_heads, c.head_dim))
            cache = ContextCache(kv, start=position)
        cache.length = position - cache.start
        self.caches[rid] = cache
        return cache

    def _evict(self, keep: set[str]) -> None:
        total = sum(c.length for c in self.caches.values())
        for rid in list(self.caches):
            if total <= self.budget:
                break
            if rid not in keep:
                total -= self.caches.pop(rid).length

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Feed this step's context of every request that may speculate; draft for the wanting ones.
        Under load (more than `disable_by_batch_size` requests, none drafting) nothing is fed."""
        if not step.wanted and len(step.req_ids) > self.disable_by_batch_size:
            return {}
        source = step.model.model.aux_hidden
        bounds = step.query_start_loc.tolist()
        fed, rows, positions, ready = [], [], [], {}
        for i, (rid, computed) in enumerate(zip(step.req_ids, step.num_computed.tolist())):
            s = step.requests[rid]
            if not s.params.speculative:
                continue
            tokens = s.prompt_token_ids + s.output_token_ids
            n = min(len(tokens) - 1 - computed, bounds[i + 1] - bounds[i])
            if n <= 0:
                continue
            fed.append((self._cache(rid, computed, source), n))
            rows.append(source[bounds[i] : bounds[i] + n])
            positions.append(torch.arange(computed, computed + n))
            if rid in step.wanted and computed + n == len(tokens) - 1:
                ready[rid] = tokens[-1]
        if not fed:
            return {}
        context = self.module.context(torch.cat(rows), torch.cat(positions).to(source.device))
        first = 0
        for cache, n in fed:
            cache.append([(k[first : first + n], v[first : first + n]) for k, v in context], self.most_per_request)
            first += n
        self._evict(set(ready))
        return self.draft(ready, step) if ready else {}

    def draft(self, newest: dict[str, int], step: DraftStep) -> dict[str, list[int]]:
        """Up to `step.wanted[r]` drafts after each request's newest token, in one block forward."""
        c, rids = self.module.config, list(newest)
        sizes = [min(step.wanted[r], c.block_size - 1) + 1 for r in rids]
        ids, positions = [], []
        for rid, size in zip(rids, sizes):
            cache = self.caches[rid]
            ids += [newest[rid]] + [c.mask_token_id] * (size - 1)
            positions += range(cache.start + cache.length, cache.start + cache.length + size)
        device = step.hidden.device
        embed = step.model.model.embed_tokens
        hidden = self.module(
            embed(torch.tensor(ids, device=device)) * c.input_embedding_scale,
            torch.tensor(positions, device=device),
            [self.caches[r].view() for r in rids],
            sizes,
        )
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        rows = [range(f + 1, f + size) for f, size in zip(firsts, sizes)]
        block = BlockStep(
            step.model.compute_logits,
            lambda t: embed(t.to(device)) * c.input_embedding_scale,
            len(step.req_ids),
            self.spec.min_confidence,
            self.spec.compute_bound_tokens,
        )
        drafts = self.module.propose(hidden, rows, [newest[r] for r in rids], block)
        return dict(zip(rids, drafts))
