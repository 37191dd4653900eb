"""Verification of drafted tokens against the target model's distribution at each position.

For a request with drafts d_1..d_k the forward pass gives the target's logits at k + 1 positions:
position i predicts the token after d_1..d_i. Greedy: drafts are accepted while they equal the
argmax; then the argmax at the first mismatch (or after the last draft, the bonus token) follows.
Sampling (standard speculative sampling, Leviathan et al. / Chen et al.): d_i is accepted with
probability min(1, p(d_i) / q(d_i)), q the distribution it was drawn from; on rejection the next
token is drawn from the residual max(p - q, 0), normalised, and nothing after it is kept. A draft
that is a deterministic choice (n-gram, Medusa heads, a draft model's argmax) has a point-mass q:
it is accepted with probability p(d_i) and the residual is p with d_i removed; a draft model that
samples its drafts hands over its q rows. Every emitted token is then distributed exactly as the
target samples it without speculation. p is the target's processed distribution (temperature,
top-k, top-p, min-p as the sampler applies them); a seeded request draws from its own generator.
"""

from __future__ import annotations

import torch

from tokenmill.sample.sampler import apply_min_p, apply_top_k_top_p, row_argmax
from tokenmill.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] float logits -> the distribution the sampler draws from for this request's settings."""
    logits = logits / params.temperature
    rows, device = logits.shape[0], logits.device
    if params.top_k or params.top_p < 1:
        top_k = torch.full((rows,), params.top_k, dtype=torch.long, device=device) if params.top_k else None
        top_p = torch.full((rows,), params.top_p, device=device) if params.top_p < 1 else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if params.min_p > 0:
        logits = apply_min_p(logits, torch.full((rows,), params.min_p, device=device))
    return logits.softmax(dim=-1)


def verify_on_device(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification of k drafts with no read of the device, so that the step reads it once at its end.
    logits [k + 1, V] (float) at the positions after the last accepted token and each draft; `drafts`
    [k] long on the logits' device; `draft_probs` [k, V]: the distribution each draft was drawn from
    (None: point masses). Returns (tokens [k + 1], accepted [] long): the request advances by
    tokens[: accepted + 1] — row i's token is its draft while every draft up to it is accepted, else the
    row's own draw (after a rejection, from the residual; after the last draft, the bonus token).

    Every row's accept test and residual draw is made at once: a row after the first rejection draws
    numbers it never uses, which changes no emitted token's distribution (draws are independent)."""
    if params.greedy:
        target = row_argmax(logits)
        return target, (drafts == target[:-1]).cumprod(0).sum()
    probs = target_probs(logits, params)
    k = drafts.shape[0]
    u = torch.rand(k, generator=generator, device=probs.device)
    p = probs[:k].gather(1, drafts.unsqueeze(1)).squeeze(1)
    if draft_probs is None:  # u < p(d): accepted; else the residual is p without d
        accept = u < p
        residual = probs[:k].scatter(1, drafts.unsqueeze(1), 0.0)
    else:  # u < p(d) / q(d); else the residual max(p - q, 0), or p where p == q up to rounding
        accept = u * draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1) < p
        residual = (probs[:k] - draft_probs).clamp_(min=0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs[:k])
    # one draw per row by the exponential race (as `random_sample`), all rows from the request's generator
    race = torch.cat([residual, probs[k:]])
    noise = torch.empty_like(race).exponential_(generator=generator).clamp_(min=torch.finfo(race.dtype).tiny)
    draws = row_argmax(race.div_(noise))
    accepted = accept.long().cumprod(0)  # 1 while every draft so far is accepted
    return torch.cat([torch.where(accepted.bool(), drafts, draws[:k]), draws[k:]]), accepted.sum()


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """`verify_on_device` for one request, read back: the accepted drafts, then one token of the target's own."""
    tokens, accepted = verify_on_device(
        logits, torch.tensor(drafts, dtype=torch.long, device=logits.device), params, generator, draft_probs
    )
    return tokens.tolist()[: int(accepted) + 1]
