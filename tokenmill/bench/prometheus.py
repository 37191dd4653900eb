"""Read a server's `/metrics` (Prometheus text format): prefix-cache counters, KV-cache usage,
mixture-of-experts routing counts, speculative-decoding counters and the engine's steps by kind.

tokenmill's names are tried first, then vLLM's (current, then older spellings).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx

from tokenmill.bench.metrics import expert_load_summary

PREFIX_QUERIES = (
    "tokenmill:prefix_cache_queries_total",
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
)
PREFIX_HITS = ("tokenmill:prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
KV_USAGE = ("tokenmill:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
KV_TIER_COUNTERS = ("queries", "hits")  # tokenmill:kv_tier_<name>_total{tier=...}: prompt tokens per KV-cache tier
EXPERT_TOKENS = "tokenmill:moe_expert_tokens_total"
RANK_TOKENS = "tokenmill:moe_rank_tokens_total"  # expert parallelism
# speculative decoding: (tokenmill, vLLM) names of the counters the run's deltas are taken of
SPEC_COUNTERS = {
    "drafts": ("tokenmill:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "draft_tokens": ("tokenmill:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "accepted_tokens": (
        "tokenmill:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
    "draft_seconds": ("tokenmill:spec_decode_draft_seconds_total",),
    "verify_seconds": ("tokenmill:spec_decode_verify_seconds_total",),
}
# the engine's steps by kind (tokenmill only): {kind: {count: metric}}
STEP_COUNTERS = {
    kind: {
        what: f"tokenmill:engine_{kind}_{name}_total"
        for what, name in (("steps", "steps"), ("tokens", "step_tokens"), ("seconds", "step_seconds"))
    }
    for kind in ("decode", "prompt")
}
SPEC_PER_POSITION = (
    "tokenmill:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def _float(text: str) -> float:
    special = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}
    return special[text.lower()] if text.lower() in special else float(text)


def _labels(text: str) -> dict:
    body = text[1:-1]
    labels, pos = {}, 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if not m:
            raise ValueError(f"bad labels {text!r}")
        labels[m.group(1)] = re.sub(r'\\[\\"n]', lambda e: _ESCAPES[e.group(0)], m.group(2))
        pos = m.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample in a Prometheus text exposition (comments and blank lines skipped)."""
    samples = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"line {lineno} is not a Prometheus sample: {line!r}")
        try:
            samples.append(Sample(m.group(1), _labels(m.group(2)) if m.group(2) else {}, _float(m.group(3))))
        except ValueError as e:
            raise ValueError(f"line {lineno}: {e}") from e
    return samples


def metric_value(samples: list[Sample], names: tuple[str, ...], model: str | None = None) -> float | None:
    """The first of `names` present, summed over its label sets (only those of `model` when they carry a
    model_name label matching it); None if none is exposed."""
    for name in names:
        matching = [s for s in samples if s.name == name]
        if not matching:
            continue
        if model is not None and any(s.labels.get("model_name") == model for s in matching):
            matching = [s for s in matching if s.labels.get("model_name") == model]
        return sum(s.value for s in matching)
    return None


def cache_stats(samples: list[Sample], model: str | None = None) -> dict:
    return {
        "prefix_cache_queries": metric_value(samples, PREFIX_QUERIES, model),
        "prefix_cache_hits": metric_value(samples, PREFIX_HITS, model),
        "kv_cache_usage": metric_value(samples, KV_USAGE, model),
        "expert_tokens": expert_tokens(samples, model),
        "rank_tokens": rank_tokens(samples, model),
        "kv_tiers": kv_tiers(samples, model),
        "spec": {key: metric_value(samples, names, model) for key, names in SPEC_COUNTERS.items()},
        "spec_per_position": accepted_per_position(samples, model),
        "steps": {
            kind: {what: metric_value(samples, (name,), model) for what, name in names.items()}
            for kind, names in STEP_COUNTERS.items()
        },
    }


def accepted_per_position(samples: list[Sample], model: str | None = None) -> dict[int, float]:
    """{draft position (0 first): accepted drafts} from the first per-position counter exposed."""
    for name in SPEC_PER_POSITION:
        counts = {
            int(s.labels["position"]): s.value
            for s in samples
            if s.name == name
            and "position" in s.labels
            and (model is None or s.labels.get("model_name") in (None, model))
        }
        if counts:
            return counts
    return {}


def expert_tokens(samples: list[Sample], model: str | None = None) -> dict[str, dict[str, float]]:
    """{layer: {expert: tokens routed}} from tokenmill's MoE counters (empty for a dense model)."""
    counts: dict[str, dict[str, float]] = {}
    for s in samples:
        if s.name == EXPERT_TOKENS and (model is None or s.labels.get("model_name") in (None, model)):
            counts.setdefault(s.labels["layer"], {})[s.labels["expert"]] = s.value
    return counts


def rank_tokens(samples: list[Sample], model: str | None = None) -> dict[str, float]:
    """{rank: tokens routed to its experts} under expert parallelism (empty otherwise)."""
    return {
        s.labels["rank"]: s.value
        for s in samples
        if s.name == RANK_TOKENS and (model is None or s.labels.get("model_name") in (None, model))
    }


def kv_tiers(samples: list[Sample], model: str | None = None) -> dict[str, dict[str, float]]:
    """{tier: {"queries": prompt tokens looked up, "hits": found}} from tokenmill's KV-cache tier counters."""
    counts: dict[str, dict[str, float]] = {}
    for key in KV_TIER_COUNTERS:
        for s in samples:
            if s.name == f"tokenmill:kv_tier_{key}_total" and (
                model is None or s.labels.get("model_name") in (None, model)
            ):
                counts.setdefault(s.labels["tier"], {})[key] = s.value
    return counts


def metrics_url(base_url: str) -> str:
    """/metrics at the server root (base URLs may end in /v1)."""
    root = base_url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/metrics"


def scrape(url: str, timeout: float = 5.0) -> list[Sample] | None:
    """The samples at `url`, or None if the server has no readable /metrics."""
    try:
        response = httpx.get(url, timeout=timeout)
        if response.status_code != 200:
            return None
        return parse_prometheus(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def cache_delta(before: dict | None, after: dict | None, kv_samples: list[float] = ()) -> dict:
    """Prefix-cache queries/hits during the run, the hit rate, and KV-cache usage before/after/peak
    (a fraction of the cache; None where the server does not expose it)."""
    before, after = before or {}, after or {}

    def delta(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None or b is None else a - b

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    experts_before = before.get("expert_tokens") or {}
    routed = [
        [n - experts_before.get(layer, {}).get(e, 0.0) for e, n in sorted(c.items(), key=lambda i: int(i[0]))]
        for layer, c in sorted((after.get("expert_tokens") or {}).items(), key=lambda i: int(i[0]))
    ]
    ranks_before = before.get("rank_tokens") or {}
    per_rank = [
        n - ranks_before.get(rank, 0.0)
        for rank, n in sorted((after.get("rank_tokens") or {}).items(), key=lambda i: int(i[0]))
    ]
    peak = [v for v in [*kv_samples, before.get("kv_cache_usage"), after.get("kv_cache_usage")] if v is not None]
    return {
        "exposed": bool(before) and any(v is not None for v in before.values()),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
        "kv_cache_usage_before": before.get("kv_cache_usage"),
        "kv_cache_usage_after": after.get("kv_cache_usage"),
        "kv_cache_usage_max": max(peak) if peak else None,
        "moe": expert_load_summary(routed, per_rank),
        "spec": spec_summary(before, after),
        "kv_tiers": tier_summary(before.get("kv_tiers") or {}, after.get("kv_tiers") or {}),
        "steps": step_summary(before.get("steps") or {}, after.get("steps") or {}),
    }


def step_summary(before: dict, after: dict) -> dict[str, dict] | None:
    """The engine's steps during the run, per kind ("decode": only each request's newest token; "prompt":
    with prompt tokens): steps, tokens, seconds and the mean step in ms; None where the server does not
    count them."""
    out = {}
    for kind, counts in after.items():
        delta = {k: v - (before.get(kind) or {}).get(k, 0.0) for k, v in counts.items() if v is not None}
        if len(delta) < 3:
            return None
        delta["steps"], delta["tokens"] = int(round(delta["steps"])), int(round(delta["tokens"]))
        delta["mean_ms"] = 1000 * delta["seconds"] / delta["steps"] if delta["steps"] else None
        out[kind] = delta
    return out or None


def tier_summary(before: dict, after: dict) -> dict[str, dict]:
    """Per KV-cache tier during the run: prompt tokens looked up, found, and the hit rate."""
    out = {}
    for tier, counts in after.items():
        queries, hits = (counts.get(k, 0.0) - before.get(tier, {}).get(k, 0.0) for k in KV_TIER_COUNTERS)
        out[tier] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}
    return out


def spec_summary(before: dict, after: dict) -> dict | None:
    """Speculative decoding during the run: verify steps, drafted / accepted tokens, the acceptance rate
    overall and by draft position (accepted at position i / verify steps), the mean tokens a verify step
    advances by (accepted + 1), time drafting and verifying; None when nothing was drafted."""
    b, a = before.get("spec") or {}, after.get("spec") or {}
    delta = {k: a[k] - b[k] for k in a if a.get(k) is not None and b.get(k) is not None}
    for k in ("drafts", "draft_tokens", "accepted_tokens"):  # counts
        if k in delta:
            delta[k] = int(round(delta[k]))
    drafts = delta.get("drafts")
    if not drafts:
        return None
    pos_before, pos_after = before.get("spec_per_position") or {}, after.get("spec_per_position") or {}
    tokens, accepted = delta.get("draft_tokens"), delta.get("accepted_tokens")
    return {
        **delta,
        "acceptance_rate": accepted / tokens if tokens and accepted is not None else None,
        "mean_accepted_length": 1 + accepted / drafts if accepted is not None else None,
        "acceptance_per_position": [(pos_after[p] - pos_before.get(p, 0.0)) / drafts for p in sorted(pos_after)],
    }


ENGINE_INFO = "tokenmill:engine_config_info"


def engine_info(samples: list[Sample]) -> dict[str, str]:
    """tokenmill's `engine_config_info` labels (its settings, model file, threads), {} for other servers."""
    return next((dict(s.labels) for s in samples if s.name == ENGINE_INFO), {})
