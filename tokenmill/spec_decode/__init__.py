"""Speculative decoding: a drafter drafts the next few tokens of a decoding request cheaply; the
target model checks them all in one forward pass (`tokenmill.sample.rejection_sampler`), and the
request advances by every draft it accepts plus one token of its own — with exactly the target's
output distribution (greedy: the same tokens; sampling: standard rejection sampling).

Flow: before each step the engine core puts in `SchedulerOutput.draft_lengths` the most drafts each
request may use after it (`eligible` requests, sized by their acceptance: `draft_length`); at the end
of the step the model runner's one drafter (`drafter.Drafter`: n-gram lookup, Medusa heads, a draft
model, EAGLE-3 / MTP fed the target's hidden states) proposes them, and they come back in
`ModelRunnerOutput.draft_token_ids`; the core keeps what the batch can verify (`Request.spec_token_ids`);
the scheduler gives such a request 1 + k tokens (KV slots for all of them) and lists the drafts in
`SchedulerOutput.spec_token_ids`; the model runner verifies them and returns the accepted tokens; the
scheduler then rolls `num_computed_tokens` back over the rejected ones (their KV slots are simply
overwritten later) before caching full blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


def eligible(request: Request) -> bool:
    """Whether a request may speculate: it did not opt out, and a structured-output constraint, if it
    has one, is in its grammar (not thinking: a reasoning end could fall among the drafts). Its drafts
    are then cut where the grammar would reject them, and each verified position i is processed as
    the sampler would after the first i drafts: the grammar mask, min_tokens, logit bias, penalties
    over the output so far plus those drafts (`ModelRunner._process_for_verify`)."""
    structured = request.structured
    return request.params.speculative and (
        structured is None or (structured.grammar_active and not structured.terminated)
    )


def draft_length(acceptance: float, min_acceptance: float, most: int) -> int:
    """Drafts worth verifying: positions i (1-based) while acceptance**i >= min_acceptance, at most `most`."""
    n, reach = 0, acceptance
    while n < most and reach >= min_acceptance:
        n, reach = n + 1, reach * acceptance
    return n
