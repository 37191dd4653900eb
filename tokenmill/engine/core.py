"""Engine core: the step loop. Each step is the step contract — `Scheduler.schedule()`, then the
executor (forward pass and sampling on the workers), then `Scheduler.update_from_output()` — plus
turning the result into `EngineCoreOutput`s. One loop serves every executor: steps go through a batch
queue as long as the executor runs steps at once (1 without a pipeline, P for a pipeline of P stages).

It works on token ids only; text (detokenization, stop strings) is the output processor's job, so
the core can run in its own process with the HTTP front end elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed import expert_parallel
from tokenmill.engine.kv_cache_coordinator import KVCacheCoordinator
from tokenmill.engine.kv_cache_manager import HASH_FUNCTIONS, KVCacheManager
from tokenmill.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.engine.request import SPEC_PRIOR, EngineCoreRequest, Request, RequestStatus
from tokenmill.engine.scheduler import RequestUpdate, Scheduler, StepTimes
from tokenmill.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from tokenmill.executor import Executor
from tokenmill.kv_transfer.base import KVConnectorOutput, check_supported, scheduler_connector
from tokenmill.spec_decode import draft_length, eligible

logger = logging.getLogger(__name__)

EXPERT_READ_INTERVAL = 1.0  # seconds between reads of the MoE expert counters while steps run (`stats`)


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
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer index -> tokens per expert
    moe_rank_tokens: list[int] = field(default_factory=list)  # expert parallelism: tokens routed to each rank's experts
    spec_drafts: int = 0  # speculative decoding: verify steps
    spec_draft_tokens: int = 0  # drafted tokens verified
    spec_accepted_tokens: int = 0  # of which accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # accepted drafts by position 1..k
    spec_draft_seconds: float = 0.0  # time spent drafting (the runner's drafter; trimming the drafts in the core)
    spec_verify_seconds: float = 0.0  # time of the steps that verified drafts
    kv_transfers: int = 0  # disaggregated prefill/decode: prompts whose KV was sent (producer) or received
    kv_transfer_bytes: int = 0  # their KV payloads
    kv_transfer_seconds: float = 0.0  # producer: copying out; consumer: asking until the payload is in
    kv_tiers: dict[str, dict] = field(default_factory=dict)  # KV-cache tier name -> its counters (disk_tier.TierStats)
    step_failures: int = 0  # steps that raised (each is retried in halves to find the requests at fault)
    requests_failed_isolated: int = 0  # requests found at fault that way and finished with an error
    steps: StepTimes = field(default_factory=StepTimes)  # the steps by kind: decodes only, with prompt tokens


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool, bad ids, ...);
    `param` names the request field at fault, `code` the kind of fault (OpenAI's error codes:
    "context_length_exceeded" for a request too long for the context or the KV pool, else "invalid_value")."""

    def __init__(self, message: str, param: str = "prompt", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


class EngineCore:
    """The step loop over an executor. `tokenizer_data` (a `tokenmill.structured.backend.TokenizerData`,
    or a function returning one) enables structured output; without it, constrained requests are
    rejected. The structured-output manager is built on the first constrained request."""

    def __init__(self, config: EngineConfig, executor: Executor, eos_token_ids: set[int], tokenizer_data=None) -> None:
        self.config = config
        self.executor = executor
        self.model_config = executor.model_config
        self.eos_token_ids = set(eos_token_ids)
        check_supported(config)  # before the executor builds the KV connector's worker half
        self.kv_cache_config = executor.initialize_kv_cache()
        model_len = self.model_config.max_position_embeddings
        asked = config.scheduler.max_model_len
        self.max_model_len = (
            self.kv_cache_config.longest_context(model_len, config.scheduler.max_num_batched_tokens)
            if asked == "auto"
            else asked or model_len
        )
        kv_config = self.kv_cache_config
        self.kv = KVCacheCoordinator(
            [  # one manager per pool: windowed pools return blocks as they leave the window
                KVCacheManager(
                    blocks,
                    config.cache.block_size,
                    config.cache.enable_prefix_caching,
                    HASH_FUNCTIONS[config.cache.prefix_cache_hash],
                    window,
                )
                for blocks, window in zip(kv_config.pool_blocks, kv_config.pool_windows)
            ]
        )
        # disaggregated prefill/decode or the disk tier: the scheduler half of the KV connector
        self.kv_connector = scheduler_connector(config, self.kv, executor)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.kv_connector)
        # steps submitted and not collected yet, oldest first, with when each was submitted
        self.batch_queue: deque[tuple[SchedulerOutput, float]] = deque()
        self.requests: dict[str, Request] = {}
        self.last_schedule: SchedulerOutput | None = None  # what the latest step ran (stats, tests)
        self._tokenizer_data = tokenizer_data
        self._structured = None  # StructuredOutputManager, built on first use
        self.compiling: list[Request] = []  # constrained requests whose grammar is not compiled yet
        # bisecting failed steps: groups of suspect requests, each to run alone in a step, first group first
        self.suspects: list[set[str]] = []
        self.num_step_failures = self.num_requests_failed_isolated = 0
        self._expert_tokens: dict[int, list[int]] = {}  # the latest reading of the MoE expert counters
        self._experts_read_at = float("-inf")
        # LoRA adapters by name -> load id (in prefix-cache keys: a reloaded name caches apart); None: off
        self.loras: dict[str, int] | None = None if config.lora is None else {}
        self._lora_loads = 0
        for name, path in (config.lora.modules if config.lora is not None else {}).items():
            self.load_lora(name, path)

    def set_tokenizer(self, eos_token_ids: set[int], tokenizer_data=None) -> None:
        """The tokenizer's facts for an engine built without them (the server's core process builds its
        engine while the front end loads the tokenizer). Not while requests run: they keep the ids they began with."""
        if self.requests:
            raise RuntimeError("set_tokenizer while requests are in flight")
        self.eos_token_ids = set(eos_token_ids)
        self._tokenizer_data = tokenizer_data

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter that requests then name as their model (`lora.peft.LoRAError` naming the
        field at fault if it cannot be)."""
        from tokenmill.lora.peft import LoRAError

        if self.loras is None:
            raise LoRAError("LoRA adapters are off: start with --enable-lora or --lora-modules", "lora_name")
        if name in self.loras:
            raise LoRAError(f"a LoRA adapter named {name!r} is loaded already", "lora_name")
        self.executor.load_lora(name, path)
        self._lora_loads += 1
        self.loras[name] = self._lora_loads

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no unfinished request runs (LoRAError otherwise, or if it is not loaded)."""
        from tokenmill.lora.peft import LoRAError

        if not self.loras or name not in self.loras:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        if any(r.params.lora_name == name for r in self.requests.values()):
            raise LoRAError(f"the LoRA adapter {name!r} is in use by unfinished requests; retry later", "lora_name")
        self.executor.unload_lora(name)
        del self.loras[name]

    @property
    def structured(self):
        """The structured-output manager (None when the engine has no tokenizer data)."""
        if self._structured is None and self._tokenizer_data is not None:
            from tokenmill.structured.manager import StructuredOutputManager

            try:
                data = self._tokenizer_data() if callable(self._tokenizer_data) else self._tokenizer_data
                self._structured = StructuredOutputManager(
                    data, self.model_config.vocab_size, self.config.grammar_timeout
                )
            except Exception:  # noqa: BLE001 - serve unconstrained requests; constrained ones are rejected
                logger.exception("cannot set up structured output; constrained requests will be rejected")
                self._tokenizer_data = None
        return self._structured

    @property
    def capacity_tokens(self) -> int:
        return self.kv.capacity_tokens

    def max_model_len_error(self) -> str | None:
        """Why an asked max_model_len cannot be served, naming the settings to change: one sequence of
        it does not fit the KV cache (None when it fits, or none was asked). The front ends (`serve`,
        `LLM`) refuse to start on it; the core alone serves what fits and rejects longer requests."""
        asked = self.config.scheduler.fixed_max_model_len
        if asked is None:
            return None
        fits = self.kv_cache_config.longest_context(asked, self.config.scheduler.max_num_batched_tokens)
        if fits >= asked:
            return None
        kv = self.kv_cache_config
        return (
            f"--max-model-len {asked} does not fit: the KV cache holds {fits} tokens of one sequence "
            f"({kv.num_blocks} blocks of {kv.block_size} tokens, {kv.total_bytes / 2**30:.3g} GiB, "
            f"{kv.bytes_per_token:,} bytes a token); give the cache more memory (--kv-cache-memory, "
            "--num-kv-blocks), store it in fewer bytes (--kv-cache-dtype int8 or fp8), or ask for "
            f"--max-model-len {fits} or auto"
        )

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a request, or raise RequestRejected if it could never be served. The caller's
        `SamplingParams` are never changed: the request gets its own copy with defaults filled in."""
        rid, prompt, params = core_request.request_id, core_request.prompt_token_ids, core_request.sampling_params
        if rid in self.requests:
            raise RequestRejected(f"request_id {rid!r} is already in use")
        n = len(prompt)
        if n == 0:
            raise RequestRejected("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("prompt", prompt),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise RequestRejected(f"{name} contains token ids outside the vocabulary [0, {vocab})", name)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - n)
        total = n + max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {total} exceeds the maximum "
                f"context length of {self.max_model_len} tokens",
                "prompt",
                "context_length_exceeded",
            )
        if total > self.capacity_tokens:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {total} tokens does not fit in the "
                f"KV cache ({self.capacity_tokens} tokens); raise --kv-cache-memory or lower max_tokens",
                "prompt",
                "context_length_exceeded",
            )
        if params.min_tokens > max_tokens:  # the room left in the context is less than min_tokens
            raise RequestRejected(
                f"min_tokens must be <= max_tokens ({max_tokens}), got {params.min_tokens!r}", "min_tokens"
            )
        params = dataclasses.replace(params, max_tokens=max_tokens)
        if params.kv_transfer_id is not None:
            if self.kv_connector is None:
                raise RequestRejected("kv_transfer_params needs a server started with --kv-role", "kv_transfer_params")
            params = self.kv_connector.prepare(params)
        if self.model_config.headless and params.pooling is None:
            raise RequestRejected(
                "this is an embedding model (its checkpoint has no LM head): it serves /v1/embeddings only", "model"
            )
        request = Request(core_request, params, self.eos_token_ids)
        if params.lora_name is not None:
            if not self.loras or params.lora_name not in self.loras:
                raise RequestRejected(f"no LoRA adapter named {params.lora_name!r} is loaded", "model")
            request.lora_id = self.loras[params.lora_name]
        budget = params.reasoning.budget if params.reasoning is not None else None
        if params.structured_output is not None or budget is not None:
            if self.structured is None:
                raise RequestRejected(
                    "structured output is not available: the engine has no tokenizer data", "structured_output"
                )
            request.structured = self.structured.new_state(
                params.structured_output, params.reasoning, request.eos_token_ids | request.stop_token_ids
            )
            if request.structured is not None and request.structured.ready:  # cached grammar
                error = request.structured.start()
                if error is not None:
                    raise RequestRejected(error, "structured_output")
        self.requests[rid] = request
        if request.structured is not None and not request.structured.ready:
            self.compiling.append(request)  # scheduled once its grammar is compiled (see _admit_compiled)
        else:
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Hand a request to the scheduler — one the KV connector holds (a consumer of disaggregated
        prefill), once its KV is in (see `_connector_output`)."""
        if self.kv_connector is None or not self.kv_connector.hold(request):
            self.scheduler.add(request)

    def _start(self, request: Request) -> EngineCoreOutput | None:
        """Hand a request to the scheduler; for a failed grammar compile, finish it instead."""
        error = request.structured.start() if request.structured is not None else None
        if error is None:
            self._schedule(request)
            return None
        logger.warning("request %s: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        del self.requests[request.request_id]
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            timestamp=time.monotonic(),
            finish_reason="abort",
            arrival_time=request.times.arrival,
            error=error,
            error_param="structured_output",
        )

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
            elif self.kv_connector is not None and self.kv_connector.request_finished(request):
                request.status = RequestStatus.FINISHED_ABORTED  # it was held: never reached the scheduler
            else:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self.compiling)
            or bool(self.batch_queue)
            or (self.kv_connector is not None and self.kv_connector.has_held())
        )

    def stats(self, fresh: bool = True) -> EngineStats:
        """The engine's counters. MoE expert counts live on the device (reading them waits for it), so
        unless `fresh`, they are read at most every EXPERT_READ_INTERVAL seconds and the last reading
        is given in between."""
        now = time.monotonic()
        if fresh or now - self._experts_read_at >= EXPERT_READ_INTERVAL:
            self._expert_tokens, self._experts_read_at = self.executor.expert_load(), now
        stats = EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting) + len(self.compiling),
            self.kv.usage,
            self.scheduler.num_preemptions,
            self.kv.prefix_queries,
            self.kv.prefix_hits,
            expert_tokens=self._expert_tokens,
            step_failures=self.num_step_failures,
            requests_failed_isolated=self.num_requests_failed_isolated,
        )
        spec = self.scheduler.spec_stats
        stats.spec_drafts, stats.spec_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        stats.spec_accepted_tokens, stats.spec_accepted_per_position = (
            spec.num_accepted_tokens,
            list(spec.accepted_per_position),
        )
        stats.spec_draft_seconds, stats.spec_verify_seconds = spec.draft_seconds, spec.verify_seconds
        stats.steps = dataclasses.replace(self.scheduler.step_times)
        if self.kv_connector is not None:
            t = self.kv_connector.stats
            stats.kv_transfers, stats.kv_transfer_bytes, stats.kv_transfer_seconds = (
                t.num_transfers,
                t.num_bytes,
                t.seconds,
            )
            stats.kv_tiers = self.kv_connector.tier_stats()
        if self._structured is not None:
            c = self._structured.compiler.stats
            stats.grammar_compiles, stats.grammar_compile_seconds = c.num_compiles, c.compile_seconds
            stats.grammar_cache_hits = c.cache_hits
        if self.config.parallel.enable_expert_parallel:
            stats.moe_rank_tokens = expert_parallel.rank_tokens(
                stats.expert_tokens, self.config.parallel.tensor_parallel_size
            )
        return stats

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def step(self) -> list[EngineCoreOutput]:
        """One turn of the step loop (vLLM's step with a batch queue): while the queue has room, schedule
        the requests not in flight and submit them; when it is full, or nothing new can run, take the
        oldest step's output. Without a pipeline the queue holds one step, so each turn runs one step.
        Returns what this turn produced, per request."""
        outputs = self._admit_compiled() if self.compiling else []
        queue = self.batch_queue
        if len(queue) < self.executor.max_concurrent_batches:
            self._isolate()
            sched = self.last_schedule = self.scheduler.schedule()
            if sched.num_scheduled_tokens or sched.finished_request_ids or sched.kv_connector_metadata is not None:
                outputs += self._attach_grammar(sched)
                if self.config.speculative is not None:
                    sched.draft_lengths = self._wanted_drafts(sched)
                start = time.perf_counter()  # before submit: without a pipeline, submit runs the whole step
                try:
                    self.executor.submit(sched)
                except Exception:  # noqa: BLE001 - find the requests at fault, keep serving the rest
                    return outputs + self._fail_step(sched)
                self.scheduler.in_flight.update(sched.num_scheduled_tokens)
                queue.append((sched, start))
                if len(queue) < self.executor.max_concurrent_batches:
                    return outputs  # room for another step before waiting on the oldest
        if not queue:
            if self.compiling and not outputs:  # nothing to run but grammars compiling: wait a little
                wait_futures([r.structured.future for r in self.compiling], timeout=0.01, return_when=FIRST_COMPLETED)
            return outputs
        sched, start = queue.popleft()
        self.scheduler.in_flight.difference_update(sched.num_scheduled_tokens)
        try:
            output = self.executor.collect()
        except Exception:  # noqa: BLE001 - find the requests at fault, keep serving the rest
            return outputs + self._fail_step(sched)
        self._cleared(sched)
        self.scheduler.step_ran(sched, time.perf_counter() - start)
        if sched.spec_token_ids:  # a step that verified drafts (and ran whatever else was scheduled)
            self.scheduler.spec_stats.verify_seconds += time.perf_counter() - start - output.draft_seconds
        outputs += self._connector_output(output.kv_connector_output)
        updates = self.scheduler.update_from_output(sched, output)
        if self.config.speculative is not None and sched.num_scheduled_tokens:
            self._propose(sched, output)
        return outputs + [self._output(u) for u in updates]

    def _fail_step(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step raised. Nothing of it is committed (the scheduler rebuilds the runner's state of its
        requests from what it last committed: `Scheduler.step_failed`), and its requests are suspects:
        one alone is at fault and finishes with an error (internals stay in the log); several are split in halves, each run alone
        in a step of its own (`_isolate`) until a step of one request fails — that one is at fault —
        or a half runs and is cleared. The requests whose KV fetch the step was to start fail too."""
        self.num_step_failures += 1
        meta = sched.kv_connector_metadata
        lost = self.kv_connector.step_failed(meta) if meta is not None else []
        ran = [rid for rid in sched.num_scheduled_tokens if rid in self.requests]
        self.scheduler.step_failed(ran)
        for group in self.suspects:
            group.difference_update(ran)
        if len(ran) > 1:
            logger.exception("a step of %d requests failed; retrying them in halves to find the cause", len(ran))
            half = len(ran) // 2
            self.suspects[:0] = [set(ran[:half]), set(ran[half:])]
            ran = []
        elif ran:
            logger.exception("request %s failed the step it ran in alone; finishing it with an error", ran[0])
            self.num_requests_failed_isolated += 1
        reason = "the engine failed on this request (it failed a step on its own; the cause is in the server log)"
        return [self._fail(rid, reason) for rid in ran + lost if rid in self.requests]

    def _isolate(self) -> None:
        """While failed steps are being bisected, only the first group of suspects still running is
        scheduled (no other request, none admitted)."""
        self.scheduler.only = None
        if not self.suspects:
            return
        running = {r.request_id for r in self.scheduler.running}
        while self.suspects and not self.suspects[0] & running:
            self.suspects.pop(0)
        if self.suspects:
            self.scheduler.only = self.suspects[0] & running

    def _cleared(self, sched: SchedulerOutput) -> None:
        """The requests of a step that ran are no longer suspects."""
        if self.suspects:
            for group in self.suspects:
                group.difference_update(sched.num_scheduled_tokens)
            self.suspects = [g for g in self.suspects if g]

    def _connector_output(self, output: KVConnectorOutput | None) -> list[EngineCoreOutput]:
        """The KV connector's report on a step: held requests whose KV is in go to the scheduler; those
        whose KV failed finish with the error."""
        if self.kv_connector is None:
            return []
        ready, failed = self.kv_connector.update_connector_output(output)
        for request in ready:
            self.scheduler.add(request)
        return [self._fail(rid, error) for rid, error in failed.items() if rid in self.requests]

    def _worth(self, request: Request, num_running: int) -> int:
        """Drafts worth verifying for `request` in a batch of `num_running`, by its acceptance rate: a
        draft costs about the same share of a step in a batch of B while a token is worth 1/B of it."""
        spec = self.config.speculative
        threshold = 1 - (1 - spec.min_acceptance) / num_running if spec.min_acceptance else 0.0
        return draft_length(request.spec_acceptance, threshold, spec.num_speculative_tokens)

    def _wanted_drafts(self, sched: SchedulerOutput) -> dict[str, int]:
        """The most drafts each request may use after this step (the runner's drafter proposes them at its
        end): eligible ones whose pending tokens this step completes, while no more than
        `disable_by_batch_size` run (`_propose` trims them to what fits). n-gram lookups cost next to
        nothing: they are asked for the most, for every request that may speculate, and `_propose` sizes
        them by the eligibility and acceptance after the step (what they are when the drafts are used)."""
        spec, running = self.config.speculative, self.scheduler.running
        if len(running) > spec.disable_by_batch_size:
            return {}
        lookup = spec.method == "ngram"
        wanted = {}
        for request in running:
            n = sched.num_scheduled_tokens.get(request.request_id)
            if n is None or request.num_computed_tokens + n < request.num_tokens:
                continue
            if lookup and request.params.speculative:
                wanted[request.request_id] = spec.num_speculative_tokens
            elif not lookup and eligible(request) and (worth := self._worth(request, len(running))):
                wanted[request.request_id] = worth
        return wanted

    def _propose(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Keep the drafts the runner's drafter made for the next step of each running request that decodes
        and may speculate, as many as fit (none while more than `disable_by_batch_size` requests run); a
        request that was not in this step keeps those it has."""
        spec, running = self.config.speculative, self.scheduler.running
        self.scheduler.spec_stats.draft_seconds += output.draft_seconds
        if not running or len(running) > spec.disable_by_batch_size:
            return
        start = time.perf_counter()
        budget = spec.max_verify_tokens - len(running)  # drafts that fit beside one token per request
        for request in running:
            if budget <= 0:
                break
            if request.num_tokens - request.num_computed_tokens != 1 or not eligible(request):
                continue
            if request.request_id not in sched.num_scheduled_tokens:
                budget -= len(request.spec_token_ids)
                continue
            left = (request.max_tokens or self.max_model_len) - len(request.output_token_ids) - 1
            room = min(self._worth(request, len(running)), left, self.max_model_len - request.num_tokens, budget)
            drafts = output.draft_token_ids.get(request.request_id, [])[:room]
            if request.structured is not None and drafts:  # up to the first token its grammar rejects
                drafts = drafts[: request.structured.matcher.validate(drafts)]
            request.spec_token_ids = drafts
            budget -= len(request.spec_token_ids)
            if not request.spec_token_ids:  # nothing to verify: the estimate drifts back towards trying
                request.spec_acceptance += 0.1 * (SPEC_PRIOR - request.spec_acceptance)
        self.scheduler.spec_stats.draft_seconds += time.perf_counter() - start

    def _attach_grammar(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Set the structured-output masks of the constrained requests that sample this step — and of
        those that verify drafts, one mask per verified position. A request whose grammar fails is
        taken out of the step and finished with an error."""
        constrained, masks, verifying, verify_masks, failed = [], [], [], [], []
        for rid, num_new in list(sched.num_scheduled_tokens.items()):
            request = self.requests[rid]
            state = request.structured
            try:
                if state is not None and rid in sched.spec_token_ids:
                    verify_masks.append(self.structured.bitmask_for_draft(state, sched.spec_token_ids[rid]))
                    verifying.append(rid)
                elif state is not None and state.needs_mask and request.samples_after(num_new):
                    masks.append(self.structured.bitmask([state]))
                    constrained.append(rid)
            except Exception as e:  # noqa: BLE001 - only this request is lost
                from tokenmill.structured.manager import grammar_failure

                logger.exception("request %s: its grammar failed", rid)
                del sched.num_scheduled_tokens[rid]
                failed.append(self._fail(rid, *grammar_failure(e)))
        if constrained or verifying:
            first, verify_rows = len(constrained), {}
            for rid, m in zip(verifying, verify_masks):
                verify_rows[rid] = (first, m.shape[0])
                first += m.shape[0]
            sched.grammar = GrammarBitmask(constrained, torch.cat(masks + verify_masks), verify_rows)
        return failed

    def _fail(self, request_id: str, error: str, error_param: str | None = None) -> EngineCoreOutput:
        """Finish a request because the engine failed on it (its blocks return to the pool)."""
        request = self.requests.pop(request_id)
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[],
            timestamp=time.monotonic(),
            finish_reason="abort",
            arrival_time=request.times.arrival,
            first_scheduled_time=request.times.first_scheduled,
            error=error,
            error_param=error_param,
        )

    def _output(self, update: RequestUpdate) -> EngineCoreOutput:
        request, status = update.request, update.status
        if status is not None:
            del self.requests[request.request_id]
        timestamp = request.times.tokens[-1] if request.times.tokens else time.monotonic()
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=update.new_token_ids,
            timestamp=timestamp,
            finish_reason=status.value if status else None,
            new_logprobs=update.new_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.times.arrival,
            first_scheduled_time=request.times.first_scheduled,
            error=update.error,
            prompt_logprobs=update.prompt_logprobs,
            pooled=update.pooled,
        )
