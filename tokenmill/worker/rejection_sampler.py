"""Verification of drafted tokens against the target model's distribution at each position.

For a request with drafts d_1..d_k the forward pass gives the target's logits at k + 1 positions:
position i predicts the token after d_1..d_i. Greedy: drafts are accepted while they equal the
argmax; then the argmax at the first mismatch (or after the last draft, the bonus token) follows.
Sampling (standard speculative sampling, Leviathan et al. / Chen et al.): the draft distribution q
of the n-gram proposer puts all mass on d_i, so d_i is accepted with probability min(1, p(d_i) / 1)
= p(d_i); on rejection the next token is drawn from the residual max(p - q, 0), normalised — p with
d_i removed — and nothing after it is kept. Every emitted token is then distributed exactly as the
target samples it without speculation. p is the target's processed distribution (temperature,
top-k, top-p, min-p as the sampler applies them); a seeded request draws from its own generator.
"""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import apply_min_p, apply_top_k_top_p, random_sample, row_argmax


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] float logits -> the distribution the sampler draws from for this request's settings."""
    logits = logits / params.temperature
    rows = logits.shape[0]
    if params.top_k or params.top_p < 1:
        top_k = torch.full((rows,), params.top_k, dtype=torch.long) if params.top_k else None
        top_p = torch.full((rows,), params.top_p) if params.top_p < 1 else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if params.min_p > 0:
        logits = apply_min_p(logits, torch.full((rows,), params.min_p))
    return logits.softmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, V] (float) at the positions after the last accepted token and each draft ->
    the tokens the request advances by: the accepted drafts, then one token of the target's own."""
    if params.greedy:
        target = row_argmax(logits).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        return drafts[:n] + [target[n]]
    probs = target_probs(logits, params)
    accepted: list[int] = []
    for i, token in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[i, token]:
            accepted.append(token)
            continue
        residual = probs[i : i + 1].clone()
        residual[0, token] = 0.0
        return accepted + random_sample(residual, {0: generator} if generator is not None else {}).tolist()
    return accepted + random_sample(probs[-1:].clone(), {0: generator} if generator is not None else {}).tolist()
