"""The model runner's own state of each request it holds, kept between steps (the scheduler sends
only what changed): its tokens, sampling parameters and generator, and its KV block table."""

from __future__ import annotations

import torch

from tokenmill.engine.request import TokenSequence
from tokenmill.engine.scheduler_output import NewRequestData


class CachedRequestState(TokenSequence):
    def __init__(self, new: NewRequestData, device: torch.device) -> None:
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids = list(new.output_token_ids)  # appended by the runner as it samples
        self.params = new.sampling_params
        self.eos_token_ids = new.eos_token_ids
        self.block_ids = [list(table) for table in new.block_ids]  # per KV pool
        self.num_computed_tokens = new.num_computed_tokens
        self.prompt_logprobs_from = 0  # the first prompt position whose next-token logprobs are still owed
        self.generator = None  # a seeded request draws from its own generator: independent of its batch
        if self.params.seed is not None:
            self.generator = torch.Generator(device).manual_seed(self.params.seed)
        # the generator's state after the last step that ran to its end: a state rebuilt after a failed
        # step (`ModelRunner._update_states`) goes on drawing from there, as if the step had not run
        self.generator_state: torch.Tensor | None = None
        self.draft: tuple[list[int], torch.Tensor] | None = None  # sampled drafts and their distributions
        self.mean_pool = MeanPool()  # mean-pooled embedding requests: the prompt's hidden states so far

    def step_done(self) -> None:
        if self.generator is not None:
            self.generator_state = self.generator.get_state()

    def rebuilt_from(self, old: CachedRequestState) -> None:
        """This state replaces `old`, which a failed step left stale: draw on from its last good step."""
        self.generator_state = old.generator_state  # still the last good step's, should this one fail too
        if self.generator is not None and old.generator_state is not None:
            self.generator.set_state(old.generator_state)

    def take_draft_probs(self, drafts: list[int]) -> torch.Tensor | None:
        """The distributions of the drafts being verified, if they were sampled (the scheduler verifies
        a prefix of what was drafted); None for point-mass drafts. Forgotten afterwards."""
        draft, self.draft = self.draft, None
        if draft is None:
            return None
        tokens, probs = draft
        if tokens[: len(drafts)] != drafts:
            raise RuntimeError("the drafts being verified are not the ones the draft model sampled")
        return probs[: len(drafts)]


class MeanPool:
    """The sum of a prompt's hidden states for its mean (an embedding), fed chunk by chunk as the steps
    compute them. Groups of GROUP positions counted from the prompt's start are each summed in one fixed
    order and added to the total one after another, so the result's bits do not depend on where the steps
    cut the prompt (how busy the server was): the same text, the same embedding."""

    GROUP = 16

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # of the whole groups so far
        self.rest: torch.Tensor | None = None  # the rows after the last whole group

    def add(self, rows: torch.Tensor, restart: bool) -> None:
        """The prompt's next hidden states (float32 [n, hidden]); `restart`: the prompt starts over."""
        if restart or self.rest is None:
            self.total, self.rest = None, rows[:0]
        rows = torch.cat([self.rest, rows])
        whole = rows.shape[0] // self.GROUP * self.GROUP
        for group in _in_order(rows[:whole].view(-1, self.GROUP, rows.shape[1])):
            self.total = group if self.total is None else self.total + group
        self.rest = rows[whole:].clone()

    def mean(self, length: int) -> torch.Tensor:
        """The mean over the prompt's `length` positions, once all were added."""
        total = self.total
        if self.rest is not None and self.rest.shape[0]:
            rest = _in_order(self.rest[None])[0]
            total = rest if total is None else total + rest
        return total / length


def _in_order(groups: torch.Tensor) -> torch.Tensor:
    """[n, k, h] -> [n, h]: each group's k rows added first to last (elementwise adds: the same bits for a
    group whatever else is summed beside it)."""
    total = groups[:, 0]
    for j in range(1, groups.shape[1]):
        total = total + groups[:, j]
    return total
