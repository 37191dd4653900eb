"""From what was observed (the probe's requests, the /metrics window) to the figures the rules judge:
plain numbers in one flat dict, None where nothing measured them (the JSON report carries them all)."""

from __future__ import annotations

import statistics

from tokenmill.bench.metrics import RequestRecord
from tokenmill.doctor.probe import ProbeResult

DRAFTS, NGRAM_MIN, NGRAM_MAX = 4, 2, 4  # prompt lookup as tokenmill's ngram drafter runs it by default


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ok(records: list[RequestRecord | None]) -> list[RequestRecord]:
    return [r for r in records if r is not None and r.success]


def probe_figures(p: ProbeResult) -> dict:
    f: dict = {"context_limit": p.context_limit, "failed_requests": len(p.failed), "skipped_phases": p.skipped}
    if p.single and p.single.success:
        f["single_ttft"] = p.single.ttft
        f["decode_step"] = _median(p.single.itl)  # one sequence's step: the decode baseline
        f["single_context"] = (p.single.prompt_tokens or 0) + p.single.output_tokens // 2
    shared = _ok(p.prefix_rest)
    if p.prefix_first and p.prefix_first.success and shared:
        prompt = p.prefix_first.prompt_tokens or p.prefix_words
        f["shared_prefix_tokens"] = int(prompt * p.prefix_words / (p.prefix_words + 8))
        f["shared_requests"] = len(shared)
        cached = [r.cached_tokens for r in shared if r.cached_tokens is not None]
        f["shared_cached_tokens"] = sum(cached) if cached else None
    conc = _ok(p.concurrent)
    if conc:
        wall = max(r.start + r.e2e for r in conc) - min(r.start for r in conc)
        f["concurrency"] = len(p.concurrent)
        f["concurrent_ttft_p50"] = _median([r.ttft for r in conc])
        f["concurrent_ttft_max"] = max(r.ttft for r in conc)
        f["concurrent_output_tokens_per_s"] = sum(r.output_tokens for r in conc) / wall if wall > 0 else None
    if p.long and p.long.success:
        f["long_prompt_tokens"] = p.long.prompt_tokens
        f["long_ttft"] = p.long.ttft
        f.update(_stall(p))
    drafted, accepted = 0, 0
    for prompt, output in p.texts:
        d, a = ngram_acceptance(prompt.split(), output.split())
        drafted, accepted = drafted + d, accepted + a
    f["ngram_drafted"] = drafted
    f["ngram_acceptance"] = accepted / drafted if drafted else None
    return f


def _stall(p: ProbeResult) -> dict:
    """The longest gap between two tokens of a decoding stream that spans the long prompt's prefill,
    against that stream's median gap."""
    start, end = p.long_sent_at, p.long_sent_at + p.long.ttft
    worst, typical = None, None
    for s in p.streams:  # stopped by the probe once the long prompt had its tokens: their timings still hold
        if s.ttft is None or not s.itl:
            continue
        t = s.start + s.ttft
        for gap in s.itl:
            if t < end and t + gap > start and (worst is None or gap > worst):
                worst, typical = gap, _median(s.itl)
            t += gap
    return {"stall_during_prefill": worst, "stream_step": typical}


def ngram_acceptance(context: list[str], output: list[str]) -> tuple[int, int]:
    """(drafted, accepted) of prompt-lookup drafting replayed over `output`: at each verify step draft
    the DRAFTS tokens that followed the latest earlier match of the last NGRAM_MAX..NGRAM_MIN tokens,
    accept the prefix that equals what came, advance by it plus the token the step itself yields."""
    seq, i = context + output, len(context)
    drafted = accepted = 0
    while i < len(seq):
        draft = _lookup(seq, i)
        if draft:
            drafted += len(draft)
            n = 0
            while n < len(draft) and i + n < len(seq) and seq[i + n] == draft[n]:
                n += 1
            accepted += n
            i += n
        i += 1
    return drafted, accepted


def _lookup(seq: list[str], i: int) -> list[str]:
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if i < n:
            continue
        tail = seq[i - n : i]
        for j in range(i - n - 1, -1, -1):
            if seq[j : j + n] == tail:
                return seq[j + n : min(j + n + DRAFTS, i)]
    return []
