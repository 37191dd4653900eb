"""Model runner: owns the model, its paged KV cache and each request's state between steps. One step:
apply the scheduler's changes, lay the scheduled tokens out as one flat batch (decodes first),
describe it once for attention, run the forward pass, mask (structured output) and sample the
requests that reach the end of their tokens — or verify the drafted tokens of speculating ones
(`rejection_sampler`) — and return their new token ids; with Medusa heads, a draft model or a drafter
fed the step's hidden states (EAGLE-3, MTP), also the drafts of the next step
(`tokenmill.spec_decode.medusa`, `.draft_model`, `.hidden_drafter`). An int8 / fp8 KV cache gets a scales tensor
per group beside it (`tokenmill.attention.kv_quant`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
import torch

from tokenmill.attention.backend import get_attention_backend
from tokenmill.attention.kv_quant import SCALE_DTYPE, is_quantized
from tokenmill.attention.kv_spec import AttentionSpec, KVCacheConfig
from tokenmill.attention.metadata import CommonAttentionMetadata, build_common_metadata
from tokenmill.config import EngineConfig, resolve_cache_dtype
from tokenmill.distributed.pipeline import IntermediateTensors
from tokenmill.engine.outputs import Logprob, ModelRunnerOutput, TokenLogprobs
from tokenmill.engine.scheduler_output import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from tokenmill.layers.attention import Attention
from tokenmill.layers.forward_context import ForwardContext, set_forward_context
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.loader import LoadedModel
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_model import DraftModelProposer, DraftRequest
from tokenmill.spec_decode.hidden_drafter import Feed, HiddenStateProposer
from tokenmill.spec_decode.medusa import load_medusa_heads
from tokenmill.sample.rejection_sampler import verify
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.sample.sampler import Sampler, SamplingMetadata, compute_logprobs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, self.dtype, loaded.quantization)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core we may use, for intra-op work
            # denormal floats (they appear in hidden states and attention) run ~100x slower on x86;
            # flushing them to zero changes nothing measurable and keeps every op at full speed
            torch.set_flush_denormal(True)
        self.backend = get_attention_backend(self.device, self.dtype, self.cache_dtype)
        self.attention_layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: list[torch.Tensor] = []  # one tensor per KV-cache group: [layers, *backend shape]
        self.kv_scales: list[torch.Tensor | None] = []  # per group, quantized caches: [layers, *shape[:-1]]
        self.speculative = spec = config.speculative
        self.medusa = self.draft_model = self.hidden_drafter = None
        if spec is not None and spec.method == "draft_model":
            self.draft_model = DraftModelProposer(config, self.model_config.vocab_size)
        if spec is not None and spec.method in ("eagle3", "mtp"):
            from tokenmill.spec_decode.eagle import load_eagle3  # model files only when used
            from tokenmill.spec_decode.mtp import load_mtp

            self.hidden_drafter = HiddenStateProposer(
                load_eagle3(spec.model, loaded) if spec.method == "eagle3" else load_mtp(loaded), loaded, config)
        if spec is not None and spec.method == "medusa":
            self.medusa = load_medusa_heads(spec.model, self.model_config.hidden_size,
                                            self.model_config.vocab_size).to(self.device)
            logger.info("Medusa: %d heads of %d residual blocks from %s (%s LM heads)", self.medusa.num_heads,
                        self.medusa.num_layers, spec.model, "own" if self.medusa.lm_heads is not None else "the target's")

    # ---- KV cache ---------------------------------------------------------------------------------

    def kv_cache_specs(self) -> dict[str, AttentionSpec]:
        return {name: layer.kv_spec(self.cache_dtype) for name, layer in self.attention_layers.items()}

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate each group's cache in the backend's shape (and a quantized one's scales) and bind every
        attention layer to its part."""
        self.kv_cache_config = config
        self.group_keys = [(group.pool, group.spec.sliding_window) for group in config.groups]
        for g, group in enumerate(config.groups):
            names = [n for n in group.layer_names if n in self.attention_layers]  # a pipeline stage's own
            shape = self.backend.kv_cache_shape(config.pool_blocks[group.pool], config.block_size, group.spec)
            cache = torch.zeros(len(names), *shape, dtype=group.spec.dtype, device=self.device)
            scales = (torch.zeros(len(names), *shape[:-1], dtype=SCALE_DTYPE, device=self.device)
                      if is_quantized(group.spec.dtype) else None)
            self.kv_caches.append(cache)
            self.kv_scales.append(scales)
            for i, name in enumerate(names):
                layer_scales = None if scales is None else scales[i]
                self.attention_layers[name].bind_kv_cache(cache[i], self.backend, g, layer_scales)
        logger.info("KV cache: %s blocks of %d tokens = %d tokens (%.2f GiB, %s: %d bytes and %d tokens per GiB, "
                    "attention %s)", " + ".join(map(str, config.pool_blocks)), config.block_size,
                    config.capacity_tokens, config.total_bytes / 2**30, self.cache_dtype, config.bytes_per_token,
                    config.tokens_per_gib,
                    self.backend.name)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by decoder layer index (empty for a dense model)."""
        return {m.layer_index: m.expert_tokens.tolist() for m in self.moe_layers}

    def warm_up(self) -> None:
        """A prefill and a decode of a throwaway request in block 0, so that kernels are compiled (or
        loaded) and first-call costs are paid before the first real request's clock starts. Block 0's
        contents are garbage afterwards, which is harmless: every block is written before it is read."""
        for sched in self.warm_up_steps():
            self.execute(sched)
        for m in self.moe_layers:
            m.expert_tokens.zero_()

    def warm_up_steps(self) -> list[SchedulerOutput]:
        """The steps of `warm_up` (a pipeline runs them through all its stages)."""
        rid, prompt = "__warmup__", [0, 0]
        pools = len(self.kv_cache_config.pool_blocks)
        new = NewRequestData(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0), set(), [[0]] * pools, 0)
        return [SchedulerOutput(new_requests=[new], num_scheduled_tokens={rid: len(prompt)}),
                SchedulerOutput(cached_requests=[CachedRequestData(rid, [[]] * pools, len(prompt))],
                                num_scheduled_tokens={rid: 1}),
                SchedulerOutput(finished_request_ids={rid})]

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                intermediate: IntermediateTensors | None = None) -> ModelRunnerOutput | IntermediateTensors:
        """One step; a pipeline stage after the first starts from the previous stage's `intermediate`
        and one before the last returns its own instead of sampling."""
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        # decodes (one new token) first: attention batches them together
        req_ids = sorted(sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in req_ids]
        num_new = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        drafts = sched.spec_token_ids
        input_ids = np.fromiter((t for r, s, c, n in zip(req_ids, states, num_computed, num_new)
                                 for t in (s.token_slice(c, c + 1) + drafts[r] if r in drafts else s.token_slice(c, c + n))),
                                dtype=np.int64, count=int(num_new.sum()))
        hidden, common = self.forward(input_ids, num_new, num_computed, [s.block_ids for s in states], intermediate)
        if isinstance(hidden, IntermediateTensors):
            return hidden
        result = ModelRunnerOutput()
        self._prompt_logprobs(result, hidden, common, states)
        rows = [i for i, (r, s, n) in enumerate(zip(req_ids, states, num_new)) if s.samples_after(int(n)) and r not in drafts]
        if rows:
            last = torch.from_numpy(common.query_start_loc[1:][rows] - 1).to(self.device)
            logits = self.model.compute_logits(hidden[last]).float()
            self._sample(result, logits, [states[i] for i in rows], sched.grammar)
        last_rows = {states[i].request_id: int(common.query_start_loc[i + 1]) - 1 for i in rows}
        for i, r in enumerate(req_ids):
            if r in drafts:  # logits after its last token and after each draft
                end = int(common.query_start_loc[i + 1])
                logits = self.model.compute_logits(hidden[end - len(drafts[r]) - 1 : end]).float()
                masked = sched.grammar is not None and r in sched.grammar.verify_rows
                if masked:  # each position's grammar mask
                    self._apply_verify_grammar(logits, sched.grammar, r)
                tokens = verify(self._process_for_verify(logits, states[i], drafts[r], masked), drafts[r],
                                states[i].params, states[i].generator, states[i].take_draft_probs(drafts[r]))
                states[i].output_token_ids.extend(tokens)
                result.sampled_token_ids[r] = tokens
                if (num := states[i].params.logprobs) is not None:  # each emitted token's, from its own row
                    ids, values, ranks = compute_logprobs(logits[: len(tokens)], torch.tensor(tokens), max(num, 1))
                    result.logprobs[r] = logprob_dicts(ids.tolist(), values.tolist(), ranks.tolist(),
                                                       [num] * len(tokens))
                last_rows[r] = end - len(drafts[r]) - 2 + len(tokens)  # the row its last token came from
        wanted = {r: k for r, k in sched.draft_lengths.items() if r in last_rows}
        if self.medusa is not None and wanted:
            self._draft_with_heads(result, hidden, last_rows, wanted)
        if self.draft_model is not None and wanted:
            start = time.perf_counter()
            for r in wanted:
                self.requests[r].draft = None
            result.draft_token_ids, probs = self.draft_model.propose(
                {r: self._draft_request(r, k, sched) for r, k in wanted.items()})
            for r, q in probs.items():  # kept for the verify step of these drafts
                self.requests[r].draft = (result.draft_token_ids[r], q)
            result.draft_seconds = time.perf_counter() - start
        if self.hidden_drafter is not None:
            self._draft_from_hidden(result, hidden, common, req_ids, states, num_computed, wanted)
        return result

    def _draft_from_hidden(self, result: ModelRunnerOutput, hidden: torch.Tensor, common: CommonAttentionMetadata,
                           req_ids: list[str], states: list[CachedRequestState], num_computed: np.ndarray,
                           wanted: dict[str, int]) -> None:
        """EAGLE-3 / MTP: feed the drafter this step's hidden states of every request that may speculate
        (its KV must follow the target's), and draft for the wanting ones (`spec_decode.hidden_drafter`).
        Under load (more than `disable_by_batch_size` requests, none drafting) nothing is fed: when drafting
        resumes, a request's drafter cache restarts where the request is (only its drafts' quality drops)."""
        if not wanted and len(req_ids) > self.speculative.disable_by_batch_size:
            return
        start = time.perf_counter()
        source = self.model.model.aux_hidden if self.hidden_drafter.aux else hidden
        bounds = common.query_start_loc.tolist()
        feeds = {r: Feed(s.prompt_token_ids + s.output_token_ids, int(c), source[bounds[i] : bounds[i + 1]])
                 for i, (r, s, c) in enumerate(zip(req_ids, states, num_computed)) if s.params.speculative}
        result.draft_token_ids = self.hidden_drafter.step(feeds, wanted)
        result.draft_seconds = time.perf_counter() - start

    def _draft_request(self, request_id: str, k: int, sched: SchedulerOutput) -> DraftRequest:
        """What the draft model is asked for a request: sampled drafts unless it is greedy or
        constrained (see `tokenmill.spec_decode.draft_model`)."""
        s = self.requests[request_id]
        left = (s.params.max_tokens or 1 << 30) - len(s.output_token_ids)
        constrained = s.params.structured_output is not None
        return DraftRequest(s.prompt_token_ids + s.output_token_ids, k, left,
                            None if constrained else s.params, s.generator)

    def _draft_with_heads(self, result: ModelRunnerOutput, hidden: torch.Tensor, last_rows: dict[str, int],
                          wanted: dict[str, int]) -> None:
        """Medusa: drafts of the tokens after each wanting request's newest token, from the hidden state
        its newest token was predicted from (every request as many as the most wanted)."""
        start = time.perf_counter()
        rids = list(wanted)
        rows = hidden[torch.tensor([last_rows[r] for r in rids], device=self.device)].float()
        drafted = self.medusa.propose(rows, lambda x: self.model.compute_logits(x.to(hidden.dtype)),
                                      max(wanted.values()))
        result.draft_token_ids = {r: d[: wanted[r]] for r, d in zip(rids, drafted)}
        result.draft_seconds = time.perf_counter() - start

    def forward(self, input_ids: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray,
                block_ids: list[list[list[int]]], intermediate: IntermediateTensors | None = None,
                **model_inputs) -> tuple[torch.Tensor | IntermediateTensors, CommonAttentionMetadata]:
        """Run the model on a flat batch (per request: its new tokens after `num_computed` cached ones,
        decodes first; `block_ids[request][pool]` its block tables; `model_inputs`: more inputs of the
        model's, e.g. a drafter's hidden states). Returns the final hidden state of every new token, and
        the step's description (of pool 0: positions and lengths are the same in all)."""
        commons = [build_common_metadata(num_new, num_computed, [tables[pool] for tables in block_ids],
                                         self.kv_cache_config.block_size, self.device)
                   for pool in range(len(self.kv_cache_config.pool_blocks))]
        (common, positions) = commons[0]
        # one backend metadata per (pool, sliding window): each group's layers read theirs
        metas = {key: self.backend.build_metadata(commons[key[0]][0], key[1]) for key in set(self.group_keys)}
        context = ForwardContext({g: metas[key] for g, key in enumerate(self.group_keys)})
        with set_forward_context(context):
            if intermediate is not None:  # a later pipeline stage starts from the previous stage's output
                model_inputs["intermediate"] = intermediate
            hidden = self.model(torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                                **model_inputs)
        return hidden, common

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            for proposer in (self.draft_model, self.hidden_drafter):
                if proposer is not None:
                    proposer.finish(rid)
        for new in sched.new_requests:
            self.requests[new.request_id] = CachedRequestState(new, self.device)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.resumed:
                state.block_ids = [list(table) for table in cached.new_block_ids]
            else:
                for table, new_ids in zip(state.block_ids, cached.new_block_ids):
                    table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prompt_logprobs(self, result: ModelRunnerOutput, hidden: torch.Tensor, common: CommonAttentionMetadata,
                         states: list[CachedRequestState]) -> None:
        """For requests that asked: the logprob of each prompt token this step's chunk predicts (the
        token after each position, up to the last prompt token), with the top-N, from raw logits."""
        rows, targets, spans = [], [], []
        for i, s in enumerate(states):
            if s.params.prompt_logprobs is None:
                continue
            start = max(s.num_computed_tokens, s.prompt_logprobs_from)
            end = min(int(common.seq_lens[i]), len(s.prompt_token_ids) - 1)  # positions predicting prompt tokens
            if start >= end:
                continue
            offset = int(common.query_start_loc[i]) - s.num_computed_tokens
            rows.extend(range(offset + start, offset + end))
            targets.extend(s.prompt_token_ids[start + 1 : end + 1])
            spans.append((s, start, end))
            s.prompt_logprobs_from = end
        if not rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        num = max(s.params.prompt_logprobs for s, _, _ in spans)
        ids, values, ranks = compute_logprobs(logits, torch.tensor(targets, device=self.device), max(num, 1))
        entries = logprob_dicts(ids.tolist(), values.tolist(), ranks.tolist(),
                                [s.params.prompt_logprobs for s, a, b in spans for _ in range(b - a)])
        k = 0
        for s, start, end in spans:
            result.prompt_logprobs[s.request_id] = (start + 1, entries[k : k + end - start])
            k += end - start

    def _sample(self, result: ModelRunnerOutput, logits: torch.Tensor, states: list[CachedRequestState],
                grammar: GrammarBitmask | None) -> None:
        params = [s.params for s in states]
        if grammar is not None and grammar.request_ids:
            self._apply_grammar(logits, states, grammar)
            masked = set(grammar.request_ids)
            for i, s in enumerate(states):  # the grammar decides where the output may end, not min_tokens
                if s.request_id in masked and s.params.min_tokens:
                    params[i] = dataclasses.replace(s.params, min_tokens=0)
        meta = SamplingMetadata.build(
            params, [s.prompt_token_ids for s in states], [s.output_token_ids for s in states],
            [s.generator for s in states], [s.eos_token_ids for s in states], vocab_size=logits.shape[1],
            device=logits.device,
        )
        out = self.sampler(logits, meta)
        token_ids = out.sampled_token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            logprobs = logprob_dicts(out.logprobs_token_ids.tolist(), out.logprobs.tolist(), out.sampled_rank.tolist(),
                                     [p.logprobs for p in params])
        for i, (state, token) in enumerate(zip(states, token_ids)):
            state.output_token_ids.append(token)
            result.sampled_token_ids[state.request_id] = [token]
            if logprobs is not None and logprobs[i] is not None:
                result.logprobs[state.request_id] = [logprobs[i]]

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, states: list[CachedRequestState], grammar: GrammarBitmask) -> None:
        """In place: forbidden tokens -> -inf (so logprobs are of the masked distribution, as in vLLM)."""
        from tokenmill.structured.backend import apply_bitmask

        row_of = {s.request_id: i for i, s in enumerate(states)}
        rows = [row_of[rid] for rid in grammar.request_ids]
        bitmask = torch.full((len(states), grammar.bitmask.shape[1]), -1, dtype=grammar.bitmask.dtype)
        bitmask[rows] = grammar.bitmask[: len(rows)]
        apply_bitmask(logits, bitmask, rows)

    def _process_for_verify(self, logits: torch.Tensor, state: CachedRequestState, drafts: list[int],
                            masked: bool) -> torch.Tensor:
        """A speculating request's k + 1 rows as the sampler would process each (min_tokens, logit bias,
        penalties) with the first i drafts appended to its output; unchanged if it asks for none."""
        p = state.params
        if masked and p.min_tokens:  # the grammar decides where the output may end, as in `_sample`
            p = dataclasses.replace(p, min_tokens=0)
        if not (p.min_tokens or p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
            return logits
        n = len(drafts) + 1
        meta = SamplingMetadata.build([p] * n, [state.prompt_token_ids] * n,
                                      [state.output_token_ids + drafts[:i] for i in range(n)], [None] * n,
                                      [state.eos_token_ids] * n, vocab_size=logits.shape[1], device=logits.device)
        return self.sampler.process(logits, meta)

    @staticmethod
    def _apply_verify_grammar(logits: torch.Tensor, grammar: GrammarBitmask, request_id: str) -> None:
        """In place, a speculating request's k + 1 verify rows: row i masked by its grammar after i drafts."""
        from tokenmill.structured.backend import apply_bitmask

        first, n = grammar.verify_rows[request_id]
        apply_bitmask(logits, grammar.bitmask[first : first + n], list(range(n)))


def logprob_dicts(ids: list[list[int]], values: list[list[float]], ranks: list[int],
                  nums: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row: {token id: Logprob} of the row's own token (column 0, with its rank) and its top-`nums[row]`
    (None for rows that did not ask)."""
    result = []
    for i, k in enumerate(nums):
        if k is None:
            result.append(None)
            continue
        entry = {ids[i][0]: Logprob(values[i][0], ranks[i])}
        for j in range(1, k + 1):
            entry.setdefault(ids[i][j], Logprob(values[i][j], j))
        result.append(entry)
    return result
