"""Scheduler: decides which tokens of which requests run in the next step, and applies what the
step produced.

One rule, as in vLLM v1: every request has `num_computed_tokens` and its tokens so far; each step
hands out a token budget, first to running requests (a decoding one needs one token, a request in
the middle of its prompt gets the next chunk), then to waiting requests in policy order. There is
no prefill or decode phase: prompt chunks and decode tokens share the step. A waiting request's
prompt tokens found in the prefix cache are not computed again, so they cost no budget; and one whose
next prompt block another running request is filling now waits for it (requests that arrive together
with one long shared prefix compute it once).

The step contract: `schedule() -> SchedulerOutput` -> executor -> `ModelRunnerOutput` ->
`update_from_output(...)`, which advances each request, appends its sampled tokens (stopping at the
first one that ends it) and finishes the requests that are done.

A KV connector (`tokenmill.kv_transfer.base`), when the engine has one, is asked at admission for
prompt tokens beyond the pool's prefix hits, and its work for the step rides on the `SchedulerOutput`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_coordinator import KVCacheCoordinator
from tokenmill.engine.outputs import ModelRunnerOutput, TokenLogprobs
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.request_queue import POLICIES
from tokenmill.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.engine.step_budget import StepBudget
from tokenmill.kv_transfer.base import KVConnectorScheduler

logger = logging.getLogger(__name__)


@dataclass
class RequestUpdate:
    """What one step did for a request that sampled: its accepted tokens and, if it ended, how."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    status: RequestStatus | None
    error: str | None = None  # the request failed (e.g. its grammar raised); status is FINISHED_ABORTED
    prompt_logprobs: list | None = None  # with its first update, if it asked
    pooled: list[float] | None = None  # an embedding request's pooled hidden state, when it finishes


@dataclass
class StepTimes:
    """The engine's steps so far, in two kinds, with the tokens they computed and their time (submit to
    result): decode steps compute only each request's newest generated token (with its drafts to verify,
    when speculating); prompt steps also compute prompt tokens (prefill chunks, a one-token last chunk
    too, alone or beside decodes, and a preempted request's recompute). Their shares of a run's time say whether it is prefill- or decode-bound,
    and their time per token how fast each kind runs (`tokenmill bench serve` reports both)."""

    decode_steps: int = 0
    decode_step_tokens: int = 0
    decode_step_seconds: float = 0.0
    prompt_steps: int = 0
    prompt_step_tokens: int = 0
    prompt_step_seconds: float = 0.0

    def record(self, prompt: bool, tokens: int, seconds: float) -> None:
        if prompt:
            self.prompt_steps += 1
            self.prompt_step_tokens += tokens
            self.prompt_step_seconds += seconds
        else:
            self.decode_steps += 1
            self.decode_step_tokens += tokens
            self.decode_step_seconds += seconds


@dataclass
class SpecDecodingStats:
    """Speculative decoding so far: verify steps, drafted and accepted tokens, acceptances by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # spent drafting
    verify_seconds: float = 0.0  # spent in steps that verified drafts

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheCoordinator,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # waiting or running
        self.waiting = POLICIES[config.policy]()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._in_runner: set[str] = set()  # requests the model runner holds state for
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        self.in_flight: set[str] = set()  # in a step not yet back (a pipeline's): not scheduled nor preempted
        # bisecting a failed step (the core's `_fail_step`): only these running requests are scheduled
        # and no waiting one is admitted; None otherwise
        self.only: set[str] | None = None
        self._stale: set[str] = set()  # in a failed step: the runner's state of them is rebuilt (`step_failed`)
        self.spec_stats = SpecDecodingStats()
        self.step_times = StepTimes()
        # the token budget of a step: max_num_batched_tokens, lower where a step would take longer than
        # max_step_ms (the core reports each step's time)
        self.step_budget = StepBudget(config.max_step_ms, config.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.step_budget.tokens
        now = time.monotonic()
        # the running requests' prompt chunks share at most `room` tokens while another request could start
        # (its share of the budget, the rest theirs); and decodes go first (one token each, and drafts), so
        # a prompt's chunk never takes a step from them
        room = max(1, int(budget * self.config.long_prefill_share)) if self._one_could_start() else budget
        # (request, new tokens, blocks it had per pool, drafted tokens among the new ones)
        scheduled: list[tuple[Request, int, list[int], list[int]]] = []
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if (
                request.status != RequestStatus.RUNNING  # preempted for an earlier one of this step
                or request.request_id in self.in_flight
                or (self.only is not None and request.request_id not in self.only)
            ):
                continue
            left = request.num_tokens - request.num_computed_tokens
            num_new = min(left, budget) if left == 1 else min(left, budget, room)
            if num_new <= 0:
                continue
            drafts = request.spec_token_ids[: budget - 1] if num_new == 1 else []
            num_new += len(drafts)
            had = [len(table) for table in self.kv.block_ids(request.request_id)]
            while not self.kv.allocate_slots(request, num_new):
                victim = self.waiting.victim(
                    [r for r in self.running if r.request_id not in self.in_flight] if self.in_flight else self.running
                )
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, had, drafts))
                budget -= num_new
                room -= num_new if left > 1 else 0
        # requests scheduled earlier in this step may have been preempted after
        for request, num_new, had, drafts in scheduled:
            if request.status == RequestStatus.RUNNING:
                if request.request_id in self._stale:
                    self._send(out, request)  # whole, as last committed here
                else:
                    tables = self.kv.block_ids(request.request_id)
                    out.cached_requests.append(
                        CachedRequestData(
                            request.request_id, [t[n:] for t, n in zip(tables, had)], request.num_computed_tokens
                        )
                    )
                out.num_scheduled_tokens[request.request_id] = num_new
                if drafts:
                    out.spec_token_ids[request.request_id] = drafts
        for request in self.running:
            request.spec_token_ids = []  # verified this step, or stale: new drafts follow the step

        # admit waiting requests only when nobody had to give way this step; one whose prefix another
        # request is computing now waits for those blocks (held back, keeping its place in the queue)
        held_back: list[Request] = []
        while (
            len(self.waiting)
            and budget > 0
            and not out.preempted_request_ids
            and self.only is None
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_hits = self.kv.get_computed_blocks(request)
            if self.kv.waits_for_prefix(request, num_hits):
                held_back.append(self.waiting.pop())
                continue
            num_external = self.connector.get_num_new_matched_tokens(request, num_hits) if self.connector else 0
            num_computed = request.num_computed_tokens = num_hits + num_external
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                request.num_computed_tokens = 0
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, self.kv.block_ids(request.request_id), num_hits, num_external
                )
            self.waiting.pop()
            self.kv.mark_computing(request, num_computed)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
                self.kv.record_lookup(request, num_computed)
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            self.running.append(request)
            self._send(out, request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        self.waiting.put_back(held_back)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out, self.requests)
        return out

    def _one_could_start(self) -> bool:
        """Whether the next waiting request could start this step: not when it waits for a prefix that a
        running request is computing (a smaller chunk of that request would only delay it)."""
        if not len(self.waiting) or self.only is not None or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self.waiting.peek()
        return not self.kv.waits_for_prefix(head, self.kv.get_computed_blocks(head)[1])

    def _send(self, out: SchedulerOutput, request: Request) -> None:
        """Describe an admitted request to the runner: whole if new to it (or its state there is stale:
        then with the output so far, which replaces that state), else its new block table."""
        rid, blocks = request.request_id, [list(t) for t in self.kv.block_ids(request.request_id)]
        if rid in self._in_runner and rid not in self._stale:
            out.cached_requests.append(CachedRequestData(rid, blocks, request.num_computed_tokens, resumed=True))
            return
        self._in_runner.add(rid)
        self._stale.discard(rid)
        out.new_requests.append(
            NewRequestData(
                rid,
                request.prompt_token_ids,
                request.params,
                request.eos_token_ids,
                blocks,
                request.num_computed_tokens,
                list(request.output_token_ids),
            )
        )

    def step_failed(self, request_ids: list[str]) -> None:
        """A step of these requests raised: nothing of it was committed here (`num_computed_tokens`,
        tokens and the prefix cache advance only in `update_from_output`), but the runner may have
        applied part of it (block tables, sampled tokens, a drafter's state). Their next step sends
        each whole, as committed here, and the runner rebuilds its state from that; the KV in their
        blocks up to `num_computed_tokens` was written by committed steps and stays valid, the slots
        after are written again. The blocks allocated for the failed step stay theirs."""
        self._stale.update(rid for rid in request_ids if rid in self._in_runner)

    def step_ran(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's result came back `seconds` after it was submitted (before `update_from_output`: each
        request's computed tokens are still those before the step)."""
        self.step_budget.observe(sched.num_scheduled_tokens, seconds)
        prompt = False
        for rid in sched.num_scheduled_tokens:
            request = self.requests.get(rid)
            # a prompt's chunk (its last one too, however short) or a recompute's: anything before its newest token
            if request is not None and request.num_computed_tokens < max(
                request.num_prompt_tokens, request.num_tokens - 1
            ):
                prompt = True
                break
        self.step_times.record(prompt, sched.total_num_scheduled_tokens, seconds)

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance every scheduled request by its tokens; append what the sampling ones drew, checking
        stops token by token; finish the requests that ended (their blocks return to the pool)."""
        now = time.monotonic()
        updates = []
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            drafts = sched.spec_token_ids.get(rid)
            if drafts:  # the KV of rejected drafts stays behind in its slots, to be overwritten
                num_accepted = len(output.sampled_token_ids.get(rid, ())) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.record(len(drafts), num_accepted)
                # a of k drafts accepted, a rejection ending the run: a per-position rate of a / (a + 1); all: 1
                observed = 1.0 if num_accepted == len(drafts) else num_accepted / (num_accepted + 1)
                request.spec_acceptance = 0.5 * request.spec_acceptance + 0.5 * observed
            else:
                self.kv.cache_full_blocks(request)
            if rid in output.prompt_logprobs and request.prompt_logprobs is not None:
                first, entries = output.prompt_logprobs[rid]
                request.prompt_logprobs[first : first + len(entries)] = entries
            tokens = output.sampled_token_ids.get(rid)
            if not tokens:
                if request.params.max_tokens == 0 and request.num_computed_tokens >= request.num_tokens:
                    status = RequestStatus.FINISHED_LENGTH  # scored its prompt: nothing to generate
                    updates.append(
                        RequestUpdate(
                            request, [], None, status, None, self._take_prompt_logprobs(request), output.pooled.get(rid)
                        )
                    )
                    self.finish(request, status)
                continue
            accepted, status, error = [], None, None
            for token in tokens:
                accepted.append(token)
                try:
                    status = self._append(request, token, now)
                except Exception:  # noqa: BLE001 - one request's grammar failing must not stop the others
                    logger.exception("request %s: accepting token %d failed", rid, token)
                    status, error = RequestStatus.FINISHED_ABORTED, "the structured-output grammar failed"
                if status is not None:
                    break
            if drafts:  # its accepted tokens are appended now (fewer if one of them ended it)
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                self.kv.cache_full_blocks(request)
            logprobs = output.logprobs.get(rid)
            updates.append(
                RequestUpdate(
                    request,
                    accepted,
                    logprobs[: len(accepted)] if logprobs else None,
                    status,
                    error,
                    self._take_prompt_logprobs(request),
                )
            )
            if status is not None:
                self.finish(request, status)
        return updates

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list | None:
        """The request's prompt logprobs, the first time it reports (None afterwards and if it did not ask)."""
        entries, request.prompt_logprobs = request.prompt_logprobs, None
        return entries

    @staticmethod
    def _append(request: Request, token: int, now: float) -> RequestStatus | None:
        status = request.append_token(token, now)
        structured = request.structured
        if structured is not None:
            if not structured.accept(token):  # only if every token was masked: should not happen
                raise RuntimeError(f"sampled token {token} is not allowed by the grammar")
            if structured.terminated:  # the grammar accepted a stop token: the output is done
                return status or RequestStatus.FINISHED_STOPPED
        return status

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and return its blocks (finished or aborted)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        self.requests.pop(request.request_id, None)
        self._stale.discard(request.request_id)
        if request.request_id in self._in_runner:
            self._in_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)
