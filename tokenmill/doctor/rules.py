"""What limits a deployment: each rule reads the measured figures and, when its limit shows, returns a
`Finding` that says so in plain words, with the numbers behind it and what to change.

Inputs (`Evidence`): `probe` (figures.probe_figures: the doctor's own requests; {} without --probe),
`window` (window.MetricsWindow.summary: /metrics deltas and peaks; {} without /metrics), `engine`
(tokenmill's `engine_config_info` labels; {} for other servers), `roofline` (shares of this machine's
bandwidth / compute, when the server runs here and the model is known), `slo_ttft` (seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.plan.roofline import expected_tokens_per_verify

STALL_RATIO = 4.0  # a decode gap this many typical steps long is a stall
STALL_MIN_SECONDS = 0.05  # ... and at least this long (shorter is not felt)
STALL_SHARE = 0.5  # ... covering this share of the long prompt's prefill: it ran in one piece, not interleaved
CHUNK_STEPS = 4  # a prompt prefilled in at least this many chunks ...
CHUNK_OVERHEAD = 5.0  # ... each costing under this many decode steps: the step's fixed cost dominates (a step
# carrying a prompt chunk runs the layer-by-layer forward, whose fixed cost on CPU is several compiled decode-only
# steps: the doctor test's 16-token chunks of a tiny model came near 3 on a busy machine)
PREFIX_MISSED = 0.2  # prefix-cache hits under this share of the shared tokens: missed
QUEUE_RATIO = 3.0  # TTFT under concurrency this many times the lone request's: queueing
BOUND = 0.5  # a share of the roofline at or above this: bound by it
NGRAM_WORTH = 0.3  # n-gram acceptance from which speculative decoding pays


@dataclass
class Evidence:
    probe: dict = field(default_factory=dict)
    window: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    roofline: dict = field(default_factory=dict)
    slo_ttft: float = 1.0


@dataclass
class Finding:
    id: str
    title: str
    evidence: list[str]  # the numbers, in words
    advice: list[str]  # what to change
    severity: int = 2  # 2: limits the deployment now; 1: costs something; 0: a fact worth knowing


def _int(engine: dict, key: str) -> int | None:
    try:
        return int(engine[key])
    except (KeyError, ValueError):
        return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def kv_pool_too_small(ev: Evidence) -> Finding | None:
    w, e = ev.window, ev.engine
    preempted = w.get("preemptions") or 0
    full_waits = w.get("waiting_while_full") or 0
    capacity, max_len = _int(e, "capacity_tokens"), _int(e, "max_model_len")
    short_pool = capacity is not None and max_len is not None and capacity < max_len
    if not (preempted > 0 or full_waits > 0):
        return None
    facts = []
    if preempted:
        facts.append(
            f"{preempted:.0f} preemption(s): requests whose KV was dropped to be computed again, in {w['seconds']:.1f} s"
        )
    if full_waits:
        facts.append(
            f"requests waited while the KV cache was full (peak use {_pct(w.get('peak_kv_usage') or 0)}, up to "
            f"{w.get('peak_waiting') or 0:.0f} waiting, {w.get('peak_running') or 0:.0f} running)"
        )
    if capacity is not None:
        facts.append(
            f"the pool holds {capacity:,} tokens ({e.get('num_kv_blocks')} blocks)"
            + (f", less than one sequence of max-model-len {max_len:,}" if short_pool else "")
        )
    gib = int(e.get("kv_cache_bytes", 0) or 0) / 2**30
    more = f"--kv-cache-memory {max(2 * gib, 0.25):.2g}" if gib else "--kv-cache-memory (GiB)"
    return Finding(
        "kv_pool_too_small",
        "The KV cache pool is too small for this traffic",
        facts,
        [
            f"give the cache more memory: {more} (or a larger --num-kv-blocks)",
            "store it in fewer bytes: --kv-cache-dtype int8 (or fp8) holds ~1.9x the tokens of a 16-bit cache",
            "bound each sequence: a shorter --max-model-len (or --max-model-len auto) so long requests cannot fill it",
        ],
    )


def max_num_seqs_too_low(ev: Evidence) -> Finding | None:
    w, e, p = ev.window, ev.engine, ev.probe
    limit = _int(e, "max_num_seqs")
    running, waiting = w.get("peak_running"), w.get("peak_waiting") or 0
    if limit is None or running is None or waiting <= 0 or running < limit:
        return None
    if (w.get("peak_kv_usage") or 0) >= 0.9:
        return None  # the pool, not the sequence cap, holds them back (kv_pool_too_small)
    facts = [
        f"{running:.0f} request(s) ran (the --max-num-seqs {limit} cap) while up to {waiting:.0f} waited, "
        f"with the KV cache at most {_pct(w.get('peak_kv_usage') or 0)} used"
    ]
    if p.get("concurrent_ttft_p50") is not None and p.get("single_ttft"):
        facts.append(
            f"{p['concurrency']} requests at once reached their first token in {_ms(p['concurrent_ttft_p50'])} "
            f"(median; the slowest {_ms(p['concurrent_ttft_max'])}) against {_ms(p['single_ttft'])} alone"
        )
    want = max(int(running + waiting), 2 * limit, p.get("concurrency") or 0)  # what arrived together
    return Finding(
        "max_num_seqs_too_low",
        "Requests queue behind --max-num-seqs while the KV cache has room",
        facts,
        [f"raise --max-num-seqs to at least {want} (decode steps batch them: each costs little more than one)"],
    )


def queueing_beyond_slo(ev: Evidence) -> Finding | None:
    p, w = ev.probe, ev.window
    ttft, alone = p.get("concurrent_ttft_p50"), p.get("single_ttft")
    queue = w.get("queue_p90")
    slow_probe = ttft is not None and alone and ttft > max(ev.slo_ttft, QUEUE_RATIO * alone)
    slow_queue = queue is not None and queue > ev.slo_ttft
    if not (slow_probe or slow_queue):
        return None
    facts = []
    if slow_probe:
        facts.append(
            f"{p['concurrency']} requests at once: first token after {_ms(ttft)} (median) against "
            f"{_ms(alone)} alone, over the {_ms(ev.slo_ttft)} TTFT objective"
        )
    if slow_queue:
        facts.append(f"90% of requests waited up to {_ms(queue)} in the queue before they were scheduled")
    return Finding(
        "queueing_beyond_slo",
        "Requests wait longer than the TTFT objective under concurrency",
        facts,
        [
            "if the findings above name a cap (--max-num-seqs, the KV pool, the prefill chunk), lift it first",
            "otherwise the machine is saturated: add replicas (tokenmill router), a smaller or quantized model, "
            "or admit fewer requests (--max-queue)",
        ],
        severity=1,
    )


def prefix_cache_missed(ev: Evidence) -> Finding | None:
    p, w, e = ev.probe, ev.window, ev.engine
    shared = p.get("shared_prefix_tokens")
    if not shared or not p.get("shared_requests"):
        return None
    expected = shared * p["shared_requests"]
    hits = p.get("shared_cached_tokens")
    source = "the replies' cached_tokens"
    if hits is None and w.get("prefix_hits") is not None:
        hits, source = w["prefix_hits"], "/metrics prefix-cache hits"
    off = e.get("enable_prefix_caching") == "False"
    if not off and (hits is None or hits >= PREFIX_MISSED * expected):
        return None
    facts = [
        f"{p['shared_requests']} requests repeated a {shared:,}-token prefix: up to {expected:,} prompt tokens "
        f"could come from the cache; {0 if hits is None else hits:,.0f} did ({source})"
    ]
    if off:
        facts.append("prefix caching is off on this server")
        advice = ["turn it on: --enable-prefix-caching (the default; vLLM: --enable-prefix-caching)"]
    else:
        advice = [
            "requests with different cache_salt values never share blocks: give one tenant one salt",
            "a prefix shorter than one block (--block-size) is never shared; an evicting pool forgets them "
            "(see the KV pool finding)",
        ]
    return Finding("prefix_cache_missed", "Shared prompt prefixes are computed again", facts, advice)


def prefill_chunk_too_small(ev: Evidence) -> Finding | None:
    p, e = ev.probe, ev.engine
    # a step of the streams that decoded beside the prompt's chunks (the same steps, the same load on the
    # machine), else the lone request's
    step = p.get("stream_step") or p.get("decode_step")
    chunk, tokens, ttft = _int(e, "max_num_batched_tokens"), p.get("long_prompt_tokens"), p.get("long_ttft")
    if None in (chunk, tokens, ttft, step) or step <= 0:
        return None
    steps = math.ceil(tokens / chunk)
    per_step = ttft / steps
    if steps < CHUNK_STEPS or per_step >= CHUNK_OVERHEAD * step:
        return None
    return Finding(
        "prefill_chunk_too_small",
        "Long prompts are prefilled in chunks too small to use the machine",
        [
            f"a {tokens:,}-token prompt took {steps} steps of --max-num-batched-tokens {chunk} and "
            f"{_ms(ttft)} to its first token: {_ms(per_step)} a chunk, about {per_step / step:.1f} decode "
            f"steps ({_ms(step)}) each, so each step's fixed cost dominates",
        ],
        [f"raise --max-num-batched-tokens (e.g. {max(512, 8 * chunk)}): fewer, fuller prefill steps"],
    )


def prefill_interferes(ev: Evidence) -> Finding | None:
    p, w, e = ev.probe, ev.window, ev.engine
    stall, step, ttft = p.get("stall_during_prefill"), p.get("stream_step"), p.get("long_ttft")
    if stall is None or not step or stall < max(STALL_RATIO * step, STALL_MIN_SECONDS, STALL_SHARE * ttft):
        return None
    chunk = _int(e, "max_num_batched_tokens")
    facts = [
        f"while a {p.get('long_prompt_tokens') or 0:,}-token prompt prefilled, a decoding stream waited "
        f"{_ms(stall)} for its next token, {stall / step:.0f}x its usual {_ms(step)} (the prompt's first "
        f"token came after {_ms(ttft)})"
    ]
    if w.get("itl_p99") and w.get("itl_p50"):
        facts.append(f"inter-token latency p50 {_ms(w['itl_p50'])}, p99 {_ms(w['itl_p99'])} (/metrics)")
    smaller = f"--max-num-batched-tokens {max(chunk // 2, 64)}" if chunk else "a smaller prefill chunk"
    return Finding(
        "prefill_interferes_with_decode",
        "Prefill of long prompts stalls the requests that are decoding",
        facts,
        [
            f"smaller chunks interleave prefill with decode steps: {smaller} (vLLM: --max-num-batched-tokens)",
            "or move prefill to its own server (tokenmill disagg-proxy)",
        ],
        severity=1,
    )


def decode_roofline(ev: Evidence) -> Finding | None:
    d, p = ev.roofline.get("decode"), ev.probe
    if not d:
        return None
    acceptance = p.get("ngram_acceptance")
    facts = [
        f"one stream decodes at {1 / d['step_seconds']:,.1f} tokens/s reading {d['bytes_per_step'] / 1e6:,.1f} MB a "
        f"token: {d['achieved_bytes_per_s'] / 1e9:,.1f} GB/s, {_pct(d['share'])} of this machine's "
        f"{d['machine_bytes_per_s'] / 1e9:,.1f} GB/s (roofline {d['roofline_tokens_per_s']:,.0f} tokens/s)"
    ]
    if acceptance is not None:
        facts.append(
            f"n-gram drafting would have accepted {_pct(acceptance)} of its drafts on the text seen "
            f"({p['ngram_drafted']} drafted words)"
        )
    if d["share"] < BOUND:
        return Finding(
            "decode_below_roofline",
            "Decode is not bound by memory bandwidth: per-token overhead dominates",
            facts,
            [
                "more concurrent requests ride on the same weight reads almost for free (batch them)",
                "a faster decode path (on CPU: the default gguf-q8 weights) helps more than fewer bytes",
            ],
            severity=0,
        )
    advice = ["fewer bytes per token: a smaller weight format (e.g. a Q4 GGUF, --quantization int4 / fp8)"]
    if acceptance is not None and acceptance >= NGRAM_WORTH:
        gain = expected_tokens_per_verify(acceptance, 4)
        advice.append(
            f"speculative decoding verifies several tokens per weight read: --speculative-config "
            f'\'{{"method": "ngram"}}\' (~{gain:.1f} tokens a step at this acceptance)'
        )
    else:
        advice.append("speculative decoding with a draft model or EAGLE-3 (the text seen is not n-gram predictable)")
    return Finding("decode_at_bandwidth_roofline", "Decode runs at the memory-bandwidth roofline", facts, advice, 1)


def prefill_compute_bound(ev: Evidence) -> Finding | None:
    c = ev.roofline.get("prefill")
    if not c or c["share"] < BOUND:
        return None
    return Finding(
        "prefill_compute_bound",
        "Prefill is bound by compute",
        [
            f"the long prompt prefilled at {c['tokens_per_s']:,.0f} tokens/s: {c['achieved_flops_per_s'] / 1e9:,.0f} "
            f"GFLOP/s, {_pct(c['share'])} of this machine's {c['compute']} rate "
            f"({c['machine_flops_per_s'] / 1e9:,.0f} GFLOP/s)"
        ],
        [
            "only fewer FLOPs help: reuse shared prefixes (prefix caching), a smaller model, or int8 compute "
            "(the gguf-q8 path on CPU)"
        ],
        severity=1,
    )


def cpu_threads_idle(ev: Evidence) -> Finding | None:
    w, e = ev.window, ev.engine
    threads, cores = _int(e, "engine_threads"), _int(e, "cpu_count")
    cpu, seconds = w.get("cpu_seconds"), w.get("seconds")
    if None in (threads, cores, cpu) or not seconds or threads >= cores or "cuda" in e.get("device", ""):
        return None
    busy = cpu / seconds
    if busy < 0.7 * threads:
        return None  # not even its own threads are busy: threads are not what limits it
    return Finding(
        "cpu_threads_idle",
        "The engine's threads leave cores of this machine idle",
        [
            f"the engine runs {threads} threads on a machine of {cores} cores and kept {busy:.1f} cores busy "
            f"over {seconds:.1f} s ({w.get('cpu_source')})"
        ],
        [
            "start it on every core (no taskset / a wider cpuset: it takes one thread per core it may use), "
            f"or run more replicas on the {cores - threads} idle cores (tokenmill router)"
        ],
    )


def huge_pages_off(ev: Evidence) -> Finding | None:
    e = ev.engine
    if e.get("huge_pages") != "never" or "cuda" in e.get("device", "cuda"):
        return None
    return Finding(
        "huge_pages_off",
        "Transparent huge pages are off: the CPU weights and KV cache sit on 4 KiB pages",
        [
            "the kernel's transparent_hugepage setting is `never`, so every 4 KiB a decode step streams costs a "
            "TLB miss (on a 2-vCPU VM a single-stream decode ran 1.2x faster with its weights on huge pages)"
        ],
        ["echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root), then restart the server"],
        severity=1,
    )


RULES = (
    kv_pool_too_small,
    max_num_seqs_too_low,
    prefix_cache_missed,
    prefill_chunk_too_small,
    prefill_interferes,
    cpu_threads_idle,
    huge_pages_off,
    decode_roofline,
    prefill_compute_bound,
    queueing_beyond_slo,
)


def diagnose(ev: Evidence) -> list[Finding]:
    """Every rule's finding, the most limiting first (rules of equal severity in RULES' order)."""
    findings = [f for rule in RULES if (f := rule(ev)) is not None]
    return sorted(findings, key=lambda f: -f.severity)
