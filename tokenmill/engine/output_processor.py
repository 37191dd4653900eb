"""Output processor: turns the core's token ids into text and vLLM-style request outputs.

It runs next to the tokenizer (in the front-end process when serving): incremental
detokenization, stop strings (the core is told to abort a request that hit one), `n > 1`
fan-out, and per-request timing metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.engine.outputs import EngineCoreOutput, Logprob
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    """One of the `n` samples of a request. `token_ids` are cumulative; `text` is the whole text once
    the sample finished (building it every step would be quadratic in the output length); the
    `delta_*` fields hold what this step added (what a stream should send now)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None  # the engine failed on it (finish_reason "abort"); see EngineCoreOutput.error
    error_param: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic-clock timestamps of one request (first sample's view for n > 1)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # if asked: one per prompt token, first None
    pooled: list[float] | None = None  # an embedding request's pooled hidden state (not normalized)


class _Sample:
    """Per-sample state: the detokenizer and the output being built."""

    def __init__(self, parent: _RequestState, index: int, tokenizer: Tokenizer) -> None:
        self.parent = parent
        p = parent.params
        self.output = CompletionOutput(index, logprobs=[] if p.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(
            tokenizer, parent.output.prompt_token_ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output
        )


class _RequestState:
    """Per-request state: its parameters, its samples and the output being built (`snapshot` reports it)."""

    def __init__(self, output: RequestOutput, params: SamplingParams) -> None:
        self.output = output
        self.params = params
        self.samples: list[_Sample] = []

    def snapshot(self) -> RequestOutput:
        outputs = [s.output for s in self.samples]
        return dataclasses.replace(self.output, outputs=outputs, finished=all(o.finished for o in outputs))


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index` of an n > 1 request: n=1, its own seed if seeded, and prompt
    logprobs for the first sample only (the others may then reuse its prompt's KV blocks)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.samples: dict[str, _Sample] = {}  # core (child) request id -> sample

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Track a request; returns the core requests of its `n` samples (the one place `n` fans out)."""
        output = RequestOutput(request_id, prompt, prompt_token_ids, [], RequestMetrics(arrival_time))
        state = _RequestState(output, params)
        self.requests[request_id] = state
        children = []
        for i in range(params.n):
            sample = _Sample(state, i, self.tokenizer)
            state.samples.append(sample)
            cid = child_request_id(request_id, i, params.n)
            self.samples[cid] = sample
            children.append(
                EngineCoreRequest(cid, prompt_token_ids, child_params(params, i), arrival_time, priority, cache_salt)
            )
        return children

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request (aborted by the user); returns its last state marked 'abort'."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for i in range(state.params.n):
            self.samples.pop(child_request_id(request_id, i, state.params.n), None)
        for s in state.samples:
            if s.output.finish_reason is None:
                s.output.finish_reason = "abort"
                s.output.text = s.detok.output_text
        return state.snapshot()

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step of core outputs. Returns the updated request outputs and the core
        request ids to abort because they hit a stop string."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for state in self.requests.values():
            for s in state.samples:
                s.output.delta_text, s.output.delta_token_ids = "", []
                s.output.delta_logprobs = None
        for co in core_outputs:
            sample = self.samples.get(co.request_id)
            if sample is None:
                continue
            state = sample.parent
            out = sample.output
            finish = co.finish_reason
            stop_reason: str | int | None = None
            text_ids = co.new_token_ids
            if finish == "stop":
                # the last token was EOS or a stop token: keep its id, but not its text
                stop_reason = co.new_token_ids[-1] if co.new_token_ids[-1] in state.params.stop_token_ids else None
                text_ids = co.new_token_ids[:-1]
            sample.detok.add_tokens(text_ids)
            if finish is None and sample.detok.stop_str is not None:
                finish, stop_reason = "stop", sample.detok.stop_str
                to_abort.append(co.request_id)
            out.token_ids.extend(co.new_token_ids)
            out.delta_token_ids = co.new_token_ids
            if co.new_logprobs is not None and out.logprobs is not None:
                out.logprobs.extend(co.new_logprobs)
                out.delta_logprobs = co.new_logprobs
            out.delta_text = sample.detok.stream_delta(finished=finish is not None)
            m = state.output.metrics
            if out.index == 0:
                m.first_scheduled_time = co.first_scheduled_time
                m.finished_time = co.timestamp  # the latest so far; final once the request finished
                if co.new_token_ids:  # (a scored prompt, or a failure, brings none)
                    m.first_token_time = m.first_token_time or co.timestamp
                    m.token_times.append(co.timestamp)
            state.output.num_cached_tokens = co.num_cached_tokens
            if co.prompt_logprobs is not None:
                state.output.prompt_logprobs = co.prompt_logprobs
            if co.pooled is not None:
                state.output.pooled = co.pooled
            if finish is not None:
                out.finish_reason, out.stop_reason = finish, stop_reason
                out.error, out.error_param = co.error, co.error_param
                out.text = sample.detok.output_text
                self.samples.pop(co.request_id, None)
            touched[state.output.request_id] = state
        results = []
        for rid, state in touched.items():
            result = state.snapshot()
            if result.finished:
                del self.requests[rid]
            results.append(result)
        return results, to_abort
