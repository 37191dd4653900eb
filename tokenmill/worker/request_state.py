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
        self.pool_sum: torch.Tensor | None = None  # mean-pooled embedding requests: the prompt's hidden states so far

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
