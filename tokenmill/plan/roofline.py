"""Roofline estimates: a step takes the longer of reading its bytes at the memory bandwidth and doing
its FLOPs at the matmul rate.

Decode step of batch B at context N reads the weights once (dense layers, the head, and the share of
routed experts the B tokens touch: `ModelFacts.expert_fraction`) plus each sequence's KV, and does
B x (2 x active weights + attention) FLOPs. Prefill of T tokens does 2 x active weights x T FLOPs (plus
attention) and reads the weights once. Speculative decoding with k drafts accepted each with
probability a yields (1 - a^(k+1)) / (1 - a) tokens per verify step (Leviathan et al., 2023), a step
that costs one decode step of k + 1 query tokens of one sequence (drafts taken as free: n-gram lookup).
Tensor parallelism over t devices is taken as ideal: t times the bandwidth, compute and memory
(all-reduces not counted). These are upper bounds: real kernels reach a fraction of both peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.plan.hardware import Hardware
from tokenmill.plan.model_facts import ModelFacts

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Step:
    tokens_per_s: float
    seconds: float
    bytes: float
    flops: float
    bound: str  # "memory" or "compute"


def _step(bytes_: float, flops: float, tokens: int, hw: Hardware, rate: float, devices: int = 1) -> Step:
    memory_s, compute_s = bytes_ / (hw.bandwidth * devices), flops / (rate * devices)
    seconds = max(memory_s, compute_s)
    return Step(tokens / seconds, seconds, bytes_, flops, "memory" if memory_s >= compute_s else "compute")


def decode_step(
    facts: ModelFacts,
    hw: Hardware,
    fmt: str,
    kv_dtype: str,
    batch: int,
    context: int,
    query_tokens: int = 1,
    devices: int = 1,
) -> Step:
    """One decode step of `batch` sequences at `context` tokens, each with `query_tokens` new tokens (a
    verify step: 1 + drafts); tokens_per_s counts the query tokens."""
    tokens = batch * query_tokens
    bytes_ = facts.decode_step_bytes(fmt, batch, context, kv_dtype, tokens)
    flops = tokens * facts.flops_per_token(context)
    return _step(bytes_, flops, tokens, hw, hw.compute_rate(fmt)[1], devices)


def prefill(facts: ModelFacts, hw: Hardware, fmt: str, tokens: int) -> Step:
    """A prompt of `tokens` in one pass: attention over the causal half of the prompt on average."""
    _held, read, experts = facts.weight_bytes(fmt)
    flops = tokens * facts.flops_per_token(tokens, prefill=True)
    return _step(read + experts * facts.expert_fraction(tokens), flops, tokens, hw, hw.compute_rate(fmt)[1])


def crossover_batch(
    facts: ModelFacts, hw: Hardware, fmt: str, kv_dtype: str, context: int, limit: int = 1 << 16
) -> int | None:
    """The smallest batch whose decode step is compute-bound (None: memory-bound up to `limit`): past
    it, more concurrent sequences cost time in proportion instead of riding on the weight reads."""
    if decode_step(facts, hw, fmt, kv_dtype, limit, context).bound == "memory":
        return None
    lo, hi = 1, limit  # the bound flips once: bytes grow slower with the batch than FLOPs do
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_step(facts, hw, fmt, kv_dtype, mid, context).bound == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo


def sequences_that_fit(
    facts: ModelFacts, fmt: str, kv_dtype: str, context: int, memory: float, devices: int = 1
) -> int:
    """Sequences of `context` tokens whose KV fits in `memory` x `devices` after the weights."""
    free = memory * devices - facts.weight_bytes(fmt)[0]
    return max(0, int(free // facts.kv_bytes_per_sequence(context, kv_dtype)))


def max_context_that_fits(facts: ModelFacts, fmt: str, kv_dtype: str, memory: float) -> int:
    """The longest context (up to the model's own) for which one sequence's KV fits beside the weights."""
    if sequences_that_fit(facts, fmt, kv_dtype, 1, memory) < 1:
        return 0
    lo, hi = 1, facts.max_context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sequences_that_fit(facts, fmt, kv_dtype, mid, memory) >= 1 else (lo, mid - 1)
    return lo


def expected_tokens_per_verify(acceptance: float, drafts: int) -> float:
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance) if acceptance < 1 else drafts + 1.0


def speculative_speedup(
    facts: ModelFacts,
    hw: Hardware,
    fmt: str,
    kv_dtype: str,
    context: int,
    acceptance: float,
    drafts: int,
    batch: int = 1,
) -> float:
    """Decode speed with `drafts` free drafts per step over plain decode, at `batch` sequences."""
    plain = decode_step(facts, hw, fmt, kv_dtype, batch, context)
    verify = decode_step(facts, hw, fmt, kv_dtype, batch, context, query_tokens=drafts + 1)
    return expected_tokens_per_verify(acceptance, drafts) * plain.seconds / verify.seconds
