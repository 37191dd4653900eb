"""Speculative decoding: proposers draft the next few tokens of a decoding request cheaply; the
target model checks them all in one forward pass (`tokenmill.worker.rejection_sampler`), and the
request advances by every draft it accepts plus one token of its own — with exactly the target's
output distribution (greedy: the same tokens; sampling: standard rejection sampling).

Flow: after each step the engine core asks the proposer for drafts of each eligible running request
(`Request.spec_token_ids`); the scheduler gives such a request 1 + k tokens (KV slots for all of
them) and lists the drafts in `SchedulerOutput.spec_token_ids`; the model runner verifies them and
returns the accepted tokens; the scheduler then rolls `num_computed_tokens` back over the rejected
ones (their KV slots are simply overwritten later) before caching full blocks.
"""

from __future__ import annotations

from tokenmill.sampling_params import SamplingParams


def eligible(params: SamplingParams) -> bool:
    """Whether a request's sampling can be verified position by position: no step-dependent
    processing (penalties, min_tokens, logit bias), no logprobs, no structured output (these run
    without speculation for now), and it did not opt out."""
    return (params.speculative and params.structured_output is None and params.logprobs is None
            and params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and not params.logit_bias and params.min_tokens == 0)


def draft_length(acceptance: float, min_acceptance: float, most: int) -> int:
    """Drafts worth verifying: positions i (1-based) while acceptance**i >= min_acceptance, at most `most`."""
    n, reach = 0, acceptance
    while n < most and reach >= min_acceptance:
        n, reach = n + 1, reach * acceptance
    return n
