"""What one step produces: the model runner's sampled tokens (`ModelRunnerOutput`, executor ->
scheduler) and the core's per-request report (`EngineCoreOutput`, core -> output processor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.kv_transfer.base import KVConnectorOutput


@dataclass
class Logprob:
    logprob: float
    rank: int


TokenLogprobs = dict[int, Logprob]  # the sampled token and the top-N, by token id


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step: its new token ids (one, or the accepted drafts and one more
    when it verified speculative tokens) and, if it asked, their logprobs. Requests in the middle of a prompt have
    no entry there, but their prompt logprobs for this chunk if they asked."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # requests that asked for prompt logprobs: (index of the first prompt token covered, one entry per token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # speculative decoding with heads on the target (Medusa): drafts for each request's next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # time spent drafting them
    # embedding requests whose prompt ended this step: the pooled final hidden state (not normalized)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # what the KV connector's worker half finished


@dataclass(kw_only=True)
class EngineCoreOutput:
    """What one step produced for one request (built by keyword: its fields are many and grow)."""

    request_id: str
    new_token_ids: list[int]
    timestamp: float
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    error: str | None = None  # with finish_reason "abort": why the request failed (shown to the client)
    error_param: str | None = None  # the request field at fault, when it was the client's input (a 400)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first output (first token: None)
    pooled: list[float] | None = None  # an embedding request's pooled hidden state, with its last output
