"""Model runner: owns the model, its paged KV cache and each request's state between steps. One step:
apply the scheduler's changes, lay the scheduled tokens out as one flat batch (decodes first),
describe it once for attention, run the forward pass, mask (structured output) and sample the
requests that reach the end of their tokens — or verify the drafted tokens of speculating ones
(`tokenmill.sample.rejection_sampler`) — and return their new token ids; with speculative decoding,
also the drafts of the next step, from the runner's one drafter (`tokenmill.spec_decode.drafter`).
Embedding requests return their prompt's pooled final hidden state instead of sampling; with LoRA
adapters (`tokenmill.lora`), the step tells the layers which tokens run which adapter. The
KV cache and the forward over it are `tokenmill.layers.paged_forward`'s, which a drafter with a model
of its own uses too."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import numpy as np
import torch

from tokenmill.attention.kv_spec import KVCacheConfig
from tokenmill.attention.metadata import CommonAttentionMetadata
from tokenmill.attention.selector import get_attention_backend
from tokenmill.config import EngineConfig, resolve_cache_dtype
from tokenmill.distributed.pipeline import IntermediateTensors
from tokenmill.engine.outputs import Logprob, ModelRunnerOutput, TokenLogprobs
from tokenmill.engine.scheduler_output import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.paged_forward import PagedForward
from tokenmill.loader import LoadedModel
from tokenmill.lora.manager import LoRAManager
from tokenmill.sample.rejection_sampler import verify_on_device
from tokenmill.sample.sampler import Sampler, SamplingMetadata, compute_logprobs, upload
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.drafter import DraftStep, make_drafter
from tokenmill.worker import heartbeat
from tokenmill.worker.cuda_graphs import capture_decode_graphs
from tokenmill.worker.host_reads import HostReads
from tokenmill.worker.offload import apply_offload
from tokenmill.worker.request_state import CachedRequestState

logger = logging.getLogger(__name__)

WARM_UP_ID = "__warmup__"  # the throwaway request of `warm_up`


def cpu_threads() -> int:
    """The intra-op threads a CPU runner uses: every core this process may use (a rank's share under
    -tp/-pp, see `executor.worker_process`). A function of its own so that the test suite, whose tiny
    models run fastest on one thread, can choose for its in-process runners (tests/conftest.py)."""
    return len(os.sched_getaffinity(0))


class ModelRunner(PagedForward):
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, loaded.dtype, loaded.quantization)
        backend = get_attention_backend(
            loaded.device, loaded.dtype, cache_dtype, config.attention_backend, config.parallel
        )
        super().__init__(loaded.model, loaded.device, cache_dtype, backend)
        self.model_config = loaded.config
        self.config = config
        self.dtype = loaded.dtype
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads())
            # denormal floats (they appear in hidden states and attention) run ~100x slower on x86;
            # flushing them to zero changes nothing measurable and keeps every op at full speed
            torch.set_flush_denormal(True)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        # hybrid CPU-GPU: experts run on the host, layers streamed from it (CUDA only; the config refuses others)
        self.streamed_layers = (
            apply_offload(self.model, config.offload, self.device, loaded.host) if config.offload.active else None
        )
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # speculative decoding: the one drafter (None without); seeded after it loaded, so that sampling
        # draws the same numbers with any drafter or none
        self.drafter = make_drafter(config, loaded) if config.speculative is not None else None
        self.lora = LoRAManager(self.model, config.lora, self.dtype, self.device) if config.lora is not None else None
        torch.manual_seed(config.seed)
        heartbeat.install(self.model)  # progress inside a step, for the server's watchdog

    # ---- KV cache ---------------------------------------------------------------------------------

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        super().initialize_kv_cache(config)
        # the largest step's ids, positions and slots of every pool, in the persistent input buffers
        self.inputs.reserve(self.config.scheduler.max_num_batched_tokens * (2 + len(config.pool_blocks)))
        logger.info(
            "KV cache: %s blocks of %d tokens = %d tokens (%.2f GiB, %s: %d bytes and %d tokens per GiB, attention %s)",
            " + ".join(map(str, config.pool_blocks)),
            config.block_size,
            config.capacity_tokens,
            config.total_bytes / 2**30,
            self.cache_dtype,
            config.bytes_per_token,
            config.tokens_per_gib,
            self.backend.name,
        )

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by decoder layer index (empty for a dense model). The
        counters stay on the device; this reads them all in one copy."""
        if not self.moe_layers:
            return {}
        counts = torch.stack([m.expert_tokens for m in self.moe_layers]).tolist()
        return {m.layer_index: c for m, c in zip(self.moe_layers, counts)}

    def warm_up(self) -> None:
        """A prefill and a decode of a throwaway request in block 0, so that kernels are compiled (or
        loaded) and first-call costs are paid before the first real request's clock starts. Block 0's
        contents are garbage afterwards, which is harmless: every block is written before it is read."""
        for sched in self.warm_up_steps():
            self.execute(sched)
        self.decode_graphs = capture_decode_graphs(self, self.config)  # CUDA: after the kernels are built

    def warm_up_steps(self) -> list[SchedulerOutput]:
        """The steps of `warm_up` (a pipeline runs them through all its stages)."""
        rid, prompt = WARM_UP_ID, [0, 0]
        pools = len(self.kv_cache_config.pool_blocks)
        new = NewRequestData(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0), set(), [[0]] * pools, 0)
        return [
            SchedulerOutput(new_requests=[new], num_scheduled_tokens={rid: len(prompt)}),
            SchedulerOutput(
                cached_requests=[CachedRequestData(rid, [[]] * pools, len(prompt))], num_scheduled_tokens={rid: 1}
            ),
            SchedulerOutput(finished_request_ids={rid}),
        ]

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors:
        """One step; a pipeline stage after the first starts from the previous stage's `intermediate`
        and one before the last returns its own instead of sampling."""
        heartbeat.beat()
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        # decodes (one new token) first: attention batches them together
        req_ids = sorted(sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in req_ids]
        num_new = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        drafts = sched.spec_token_ids
        input_ids = np.fromiter(
            (
                t
                for r, s, c, n in zip(req_ids, states, num_computed, num_new)
                for t in (s.token_slice(c, c + 1) + drafts[r] if r in drafts else s.token_slice(c, c + n))
            ),
            dtype=np.int64,
            count=int(num_new.sum()),
        )
        stage_input = {} if intermediate is None else {"intermediate": intermediate}  # a later pipeline stage
        lora = None if self.lora is None else self.lora.batch([s.params.lora_name for s in states], num_new)
        hidden, common = self.forward(
            input_ids, num_new, num_computed, [s.block_ids for s in states], lora, **stage_input
        )
        if isinstance(hidden, IntermediateTensors):
            return hidden
        result, reads = ModelRunnerOutput(), HostReads()  # every value the host needs: one read at the end
        self._prompt_logprobs(result, hidden, common, states, reads)
        self._pool(result.pooled, hidden, common, states, reads)
        rows = [
            i
            for i, (r, s, n) in enumerate(zip(req_ids, states, num_new))
            if s.samples_after(int(n)) and r not in drafts
        ]
        if rows:
            last = upload(torch.from_numpy(common.query_start_loc[1:][rows] - 1), self.device)
            logits = self.model.compute_logits(hidden[last]).float()
            self._sample(result, logits, [states[i] for i in rows], sched.grammar, reads)
        last_rows = {states[i].request_id: int(common.query_start_loc[i + 1]) - 1 for i in rows}
        for i, r in enumerate(req_ids):
            if r in drafts:  # logits after its last token and after each draft
                end = int(common.query_start_loc[i + 1])
                logits = self.model.compute_logits(hidden[end - len(drafts[r]) - 1 : end]).float()
                masked = sched.grammar is not None and r in sched.grammar.verify_rows
                if masked:  # each position's grammar mask
                    self._apply_verify_grammar(logits, sched.grammar, r)
                tokens, accepted = verify_on_device(
                    self._process_for_verify(logits, states[i], drafts[r], masked),
                    upload(torch.tensor(drafts[r], dtype=torch.long), self.device),  # host
                    states[i].params,
                    states[i].generator,
                    states[i].take_draft_probs(drafts[r]),
                )
                num = states[i].params.logprobs  # each emitted token's, from its own row
                logprobs = [] if num is None else compute_logprobs(logits, tokens, max(num, 1))
                first_row = end - len(drafts[r]) - 1
                reads.add(
                    [tokens, accepted, *logprobs],
                    functools.partial(self._verified, result, states[i], num, last_rows, first_row),
                )
        reads.read()
        if self.drafter is not None:
            start = time.perf_counter()
            result.draft_token_ids = self.drafter.propose(
                DraftStep(
                    {r: k for r, k in sched.draft_lengths.items() if r in last_rows},
                    req_ids,
                    self.requests,
                    num_computed,
                    common.query_start_loc,
                    hidden,
                    last_rows,
                    self.model,
                )
            )
            result.draft_seconds = time.perf_counter() - start
        for state in states:
            state.step_done()
        return result

    @staticmethod
    def _verified(
        result: ModelRunnerOutput,
        state: CachedRequestState,
        num: int | None,
        last_rows: dict[str, int],
        first_row: int,
        tokens: list[int],
        accepted: int,
        *logprobs: list,
    ) -> None:
        """A speculating request's verified rows, read: it advances by its accepted drafts and one token."""
        tokens = tokens[: accepted + 1]
        state.output_token_ids.extend(tokens)
        result.sampled_token_ids[state.request_id] = tokens
        if num is not None:
            ids, values, ranks = (part[: len(tokens)] for part in logprobs)
            result.logprobs[state.request_id] = logprob_dicts(ids, values, ranks, [num] * len(tokens))
        last_rows[state.request_id] = first_row + len(tokens) - 1  # the row its last token came from

    def _update_states(self, sched: SchedulerOutput) -> None:
        if WARM_UP_ID in sched.finished_request_ids:  # every pipeline stage sees it: no stage counts warm-up
            for m in self.moe_layers:
                m.expert_tokens.zero_()
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            if self.drafter is not None:
                self.drafter.finish(rid)
        for new in sched.new_requests:
            state = CachedRequestState(new, self.device)
            if (stale := self.requests.get(new.request_id)) is not None:  # after a failed step
                state.rebuilt_from(stale)
                if self.drafter is not None:
                    self.drafter.finish(new.request_id)
            self.requests[new.request_id] = state
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.resumed:
                state.block_ids = [list(table) for table in cached.new_block_ids]
            else:
                for table, new_ids in zip(state.block_ids, cached.new_block_ids):
                    table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def load_lora(self, name: str, path: str) -> None:
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start with --enable-lora or --lora-modules")
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.lora.unload(name)

    @staticmethod
    def _pool(
        pooled: dict[str, list[float]],
        hidden: torch.Tensor,
        common: CommonAttentionMetadata,
        states: list[CachedRequestState],
        reads: HostReads,
    ) -> None:
        """Embedding requests: the final hidden state of the last prompt token, or the mean over the
        prompt (summed as the chunks come, the same bits however the steps cut it: `MeanPool`; a request
        that starts over after preemption starts the sum over),
        once this step's chunk ends the prompt, into `pooled` (the step's `ModelRunnerOutput.pooled`)."""
        for i, s in enumerate(states):
            if s.params.pooling is None:
                continue
            start, end = int(common.query_start_loc[i]), int(common.query_start_loc[i + 1])
            done = s.num_computed_tokens + end - start >= len(s.prompt_token_ids)
            if s.params.pooling == "mean":
                s.mean_pool.add(hidden[start:end].float(), restart=s.num_computed_tokens == 0)
                if done:
                    reads.add(
                        [s.mean_pool.mean(len(s.prompt_token_ids))],
                        functools.partial(pooled.__setitem__, s.request_id),
                    )
            elif done:
                reads.add([hidden[end - 1].float()], functools.partial(pooled.__setitem__, s.request_id))

    def _prompt_logprobs(
        self,
        result: ModelRunnerOutput,
        hidden: torch.Tensor,
        common: CommonAttentionMetadata,
        states: list[CachedRequestState],
        reads: HostReads,
    ) -> None:
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
        rows, targets = (upload(torch.tensor(v, dtype=torch.long), self.device) for v in (rows, targets))  # host
        logits = self.model.compute_logits(hidden[rows])
        num = max(s.params.prompt_logprobs for s, _, _ in spans)

        def use(ids: list, values: list, ranks: list) -> None:
            nums = [s.params.prompt_logprobs for s, a, b in spans for _ in range(b - a)]
            entries, k = logprob_dicts(ids, values, ranks, nums), 0
            for s, start, end in spans:
                result.prompt_logprobs[s.request_id] = (start + 1, entries[k : k + end - start])
                k += end - start

        reads.add(list(compute_logprobs(logits, targets, max(num, 1))), use)

    def _sample(
        self,
        result: ModelRunnerOutput,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        grammar: GrammarBitmask | None,
        reads: HostReads,
    ) -> None:
        params = [s.params for s in states]
        if grammar is not None and grammar.request_ids:
            self._apply_grammar(logits, states, grammar)
            masked = set(grammar.request_ids)
            for i, s in enumerate(states):  # the grammar decides where the output may end, not min_tokens
                if s.request_id in masked and s.params.min_tokens:
                    params[i] = dataclasses.replace(s.params, min_tokens=0)
        meta = SamplingMetadata.build(
            params,
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            [s.eos_token_ids for s in states],
            vocab_size=logits.shape[1],
            device=logits.device,
        )
        out = self.sampler(logits, meta)
        logprobs = [] if out.logprobs is None else [out.logprobs_token_ids, out.logprobs, out.sampled_rank]
        reads.add(
            [out.sampled_token_ids, *logprobs],
            functools.partial(self._sampled, result, states, [p.logprobs for p in params]),
        )

    @staticmethod
    def _sampled(
        result: ModelRunnerOutput, states: list[CachedRequestState], nums: list[int | None], token_ids, *logprobs
    ) -> None:
        """The sampled rows, read: each request's token (and logprobs, for those that asked)."""
        entries = logprob_dicts(*logprobs, nums) if logprobs else [None] * len(states)
        for state, token, entry in zip(states, token_ids, entries):
            state.output_token_ids.append(token)
            result.sampled_token_ids[state.request_id] = [token]
            if entry is not None:
                result.logprobs[state.request_id] = [entry]

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, states: list[CachedRequestState], grammar: GrammarBitmask) -> None:
        """In place: forbidden tokens -> -inf (so logprobs are of the masked distribution, as in vLLM)."""
        from tokenmill.structured.backend import apply_bitmask

        row_of = {s.request_id: i for i, s in enumerate(states)}
        rows = [row_of[rid] for rid in grammar.request_ids]
        width = grammar.bitmask.shape[1]
        bitmask = torch.full((len(states), width), -1, dtype=grammar.bitmask.dtype)  # host, as the grammar's
        bitmask[rows] = grammar.bitmask[: len(rows)]
        apply_bitmask(logits, bitmask, rows)

    def _process_for_verify(
        self, logits: torch.Tensor, state: CachedRequestState, drafts: list[int], masked: bool
    ) -> torch.Tensor:
        """A speculating request's k + 1 rows as the sampler would process each (min_tokens, logit bias,
        penalties) with the first i drafts appended to its output; unchanged if it asks for none."""
        p = state.params
        if masked and p.min_tokens:  # the grammar decides where the output may end, as in `_sample`
            p = dataclasses.replace(p, min_tokens=0)
        if not (p.min_tokens or p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
            return logits
        n = len(drafts) + 1
        meta = SamplingMetadata.build(
            [p] * n,
            [state.prompt_token_ids] * n,
            [state.output_token_ids + drafts[:i] for i in range(n)],
            [None] * n,
            [state.eos_token_ids] * n,
            vocab_size=logits.shape[1],
            device=logits.device,
        )
        return self.sampler.process(logits, meta)

    @staticmethod
    def _apply_verify_grammar(logits: torch.Tensor, grammar: GrammarBitmask, request_id: str) -> None:
        """In place, a speculating request's k + 1 verify rows: row i masked by its grammar after i drafts."""
        from tokenmill.structured.backend import apply_bitmask

        first, n = grammar.verify_rows[request_id]
        apply_bitmask(logits, grammar.bitmask[first : first + n], list(range(n)))


def logprob_dicts(
    ids: list[list[int]], values: list[list[float]], ranks: list[int], nums: list[int | None]
) -> list[TokenLogprobs | None]:
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
