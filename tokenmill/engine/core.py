"""Engine core: the step loop. Schedules, runs the model, samples, and reports new tokens.

It works on token ids only; text (detokenization, stop strings) is the output processor's job, so
the core can run in its own process with the HTTP front end elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache_manager import HASH_FUNCTIONS, KVCacheManager
from tokenmill.engine.model_runner import ModelRunner, StepSequence
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampler import Sampler, SamplingMetadata
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.loader import LoadedModel
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Logprob:
    logprob: float
    rank: int


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    timestamp: float
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    new_logprobs: list[dict[int, Logprob]] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    grammar_compiles: int = 0  # structured-output grammars compiled (cache misses)
    grammar_compile_seconds: float = 0.0  # their total compile time
    grammar_cache_hits: int = 0


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""


class EngineCore:
    """The step loop. `tokenizer_data` (a `tokenmill.structured.backend.TokenizerData`, or a function
    returning one) enables structured output; without it, constrained requests are rejected. The
    structured-output manager is built on the first constrained request."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, eos_token_ids: set[int],
                 tokenizer_data=None) -> None:
        self.config = config
        self.model_config = loaded.config
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or loaded.config.max_position_embeddings
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(loaded, config.cache)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 HASH_FUNCTIONS[config.cache.prefix_cache_hash])
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.last_schedule: SchedulerOutput | None = None  # what the latest step ran (stats, tests)
        self._tokenizer_data = tokenizer_data
        self._structured = None  # StructuredOutputManager, built on first use
        self.compiling: list[Request] = []  # constrained requests whose grammar is not compiled yet

    @property
    def structured(self):
        """The structured-output manager (None when the engine has no tokenizer data)."""
        if self._structured is None and self._tokenizer_data is not None:
            from tokenmill.structured.manager import StructuredOutputManager

            try:
                data = self._tokenizer_data() if callable(self._tokenizer_data) else self._tokenizer_data
                self._structured = StructuredOutputManager(data, self.model_config.vocab_size)
            except Exception:  # noqa: BLE001 - serve unconstrained requests; constrained ones are rejected
                logger.exception("cannot set up structured output; constrained requests will be rejected")
                self._tokenizer_data = None
        return self._structured

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request, or raise RequestRejected if it could never be served."""
        if request_id in self.requests:
            raise RequestRejected(f"request_id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt contains token ids outside the vocabulary [0, {vocab})")
        if params.max_tokens is None:
            params.max_tokens = max(1, self.max_model_len - n)
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the maximum "
                f"context length of {self.max_model_len} tokens"
            )
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} tokens does not fit in the "
                f"KV cache ({self.capacity_tokens} tokens); raise --kv-cache-memory or lower max_tokens"
            )
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time, priority,
                          self.runner.device, cache_salt)
        budget = params.reasoning.budget if params.reasoning is not None else None
        if params.structured_output is not None or budget is not None:
            if self.structured is None:
                raise RequestRejected("structured output is not available: the engine has no tokenizer data")
            request.structured = self.structured.new_state(params.structured_output, params.reasoning,
                                                           request.eos_token_ids | request.stop_token_ids)
            if request.structured is not None and request.structured.ready:  # cached grammar
                error = request.structured.start()
                if error is not None:
                    raise RequestRejected(error)
        self.requests[request_id] = request
        if request.structured is not None and not request.structured.ready:
            self.compiling.append(request)  # scheduled once its grammar is compiled (see _admit_compiled)
        else:
            self.scheduler.add(request)

    def _start(self, request: Request) -> EngineCoreOutput | None:
        """Hand a request to the scheduler; for a failed grammar compile, finish it instead."""
        error = request.structured.start() if request.structured is not None else None
        if error is None:
            self.scheduler.add(request)
            return None
        logger.error("request %s: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        del self.requests[request.request_id]
        return EngineCoreOutput(request.request_id, [], time.monotonic(), "abort",
                                arrival_time=request.times.arrival)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar finished compiling to the scheduler (never blocks)."""
        failed = []
        still = []
        for request in self.compiling:
            if request.structured.ready:
                out = self._start(request)
                if out is not None:
                    failed.append(out)
            else:
                still.append(request)
        self.compiling = still
        return failed

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request in self.compiling:
                self.compiling.remove(request)
                request.status = RequestStatus.FINISHED_ABORTED
            else:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    def stats(self) -> EngineStats:
        stats = EngineStats(len(self.scheduler.running), len(self.scheduler.waiting) + len(self.compiling),
                            self.kv.usage, self.scheduler.num_preemptions, self.kv.prefix_queries,
                            self.kv.prefix_hits)
        if self._structured is not None:
            c = self._structured.compiler.stats
            stats.grammar_compiles, stats.grammar_compile_seconds = c.num_compiles, c.compile_seconds
            stats.grammar_cache_hits = c.cache_hits
        return stats

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def step(self) -> list[EngineCoreOutput]:
        failed = self._admit_compiled() if self.compiling else []
        sched = self.last_schedule = self.scheduler.schedule()
        if not sched.scheduled:
            if self.compiling and not failed:  # nothing to run but grammars compiling: wait a little
                wait_futures([r.structured.future for r in self.compiling], timeout=0.01,
                             return_when=FIRST_COMPLETED)
            return failed
        # single-token sequences first: the attention backend batches them together
        items = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        seqs = []
        for s in items:
            r = s.request
            c = r.num_computed_tokens
            seqs.append(StepSequence(r.token_slice(c, c + s.num_new_tokens), c, self.kv.block_ids(r.request_id),
                                     s.completes_prompt))
        logits = self.runner.execute(seqs)
        sampling = [s.request for s in items if s.completes_prompt]
        for s in items:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)
        if not sampling:
            return failed

        params = [r.params for r in sampling]
        masked = [(i, r.structured) for i, r in enumerate(sampling)
                  if r.structured is not None and r.structured.needs_mask]
        if masked:
            # in place: forbidden tokens -> -inf (so logprobs are of the masked distribution, as in vLLM)
            self.structured.apply(logits, masked)
            for i, _ in masked:  # the grammar decides where the output may end, not min_tokens
                if params[i].min_tokens:
                    params[i] = dataclasses.replace(params[i], min_tokens=0)
        meta = SamplingMetadata.build(
            params, [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling], [r.generator for r in sampling],
            [r.eos_token_ids for r in sampling], vocab_size=logits.shape[1], device=logits.device,
        )
        out = self.sampler(logits, meta)
        token_ids = out.sampled_token_ids.tolist()
        logprobs = self._logprobs_lists(out, sampling)
        now = time.monotonic()
        outputs = failed
        for i, (request, token) in enumerate(zip(sampling, token_ids)):
            status = request.append_token(token, now)
            if request.structured is not None:
                if not request.structured.accept(token):  # only if every token was masked: should not happen
                    logger.error("request %s: sampled token %d is not allowed by its grammar; aborting it",
                                 request.request_id, token)
                    status = RequestStatus.FINISHED_ABORTED
                elif request.structured.terminated:  # the grammar accepted a stop token: the output is done
                    status = status or RequestStatus.FINISHED_STOPPED
            outputs.append(EngineCoreOutput(
                request.request_id, [token], now, status.value if status else None,
                [logprobs[i]] if logprobs and logprobs[i] is not None else None,
                request.num_cached_tokens, request.times.arrival, request.times.first_scheduled,
            ))
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[request.request_id]
        return outputs

    @staticmethod
    def _logprobs_lists(out, requests: list[Request]) -> list[dict[int, Logprob] | None] | None:
        if out.logprobs is None:
            return None
        ids, values, ranks = out.logprobs_token_ids.tolist(), out.logprobs.tolist(), out.sampled_rank.tolist()
        result = []
        for i, r in enumerate(requests):
            k = r.params.logprobs
            if k is None:
                result.append(None)
                continue
            entry = {ids[i][0]: Logprob(values[i][0], ranks[i])}
            for j in range(1, k + 1):
                entry.setdefault(ids[i][j], Logprob(values[i][j], j))
            result.append(entry)
        return result

