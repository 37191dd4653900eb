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

from tokenmill.sample.sampler import apply_min_p, apply_top_k_top_p, random_sample, row_argmax
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


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """logits [k + 1, V] (float) at the positions after the last accepted token and each draft ->
    the tokens the request advances by: the accepted drafts, then one token of the target's own.
    `draft_probs` [k, V]: the distribution each draft was drawn from (None: point masses)."""
    if params.greedy:
        target = row_argmax(logits).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        return drafts[:n] + [target[n]]
    probs = target_probs(logits, params)
    accepted: list[int] = []
    generators = {0: generator} if generator is not None else {}
    for i, token in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        q = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if u * q < probs[i, token]:  # u < p / q
            accepted.append(token)
            continue
        if draft_probs is None:
            residual = probs[i : i + 1].clone()
            residual[0, token] = 0.0
        else:
            residual = (probs[i : i + 1] - draft_probs[i : i + 1]).clamp_(min=0.0)
            if not residual.sum() > 0:  # p == q up to rounding: a rejection had probability ~0
                residual = probs[i : i + 1].clone()
        return accepted + random_sample(residual, generators).tolist()
    return accepted + random_sample(probs[-1:].clone(), generators).tolist()
