"""`tokenmill doctor`'s parts without a server: histogram deltas and quantiles as Prometheus computes
them, n-gram acceptance replayed over text, each rule on figures that should and should not trigger
it, the roofline shares, and the server's `engine_config_info` / whole-server CPU metrics."""

from __future__ import annotations

import math

import pytest

from tokenmill.bench.prometheus import Sample, engine_info, parse_prometheus
from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.doctor.figures import ngram_acceptance
from tokenmill.doctor.rules import Evidence, diagnose
from tokenmill.doctor.window import histogram_delta, histogram_quantile
from tokenmill.plan.hardware import Hardware
from tokenmill.plan.measured import compute_share, decode_share
from tokenmill.plan.model_facts import LayerKV, ModelFacts
from tokenmill.server.metrics import ServerMetrics


def _hist(name: str, counts: dict[str, float]) -> list[Sample]:
    return [Sample(f"{name}_bucket", {"le": le, "model_name": "m"}, n) for le, n in counts.items()]


def test_histogram_delta_and_quantile():
    name = "tokenmill:inter_token_latency_seconds"
    before = _hist(name, {"0.01": 5, "0.1": 5, "1.0": 5, "+Inf": 5})
    after = _hist(name, {"0.01": 5, "0.1": 95, "1.0": 105, "+Inf": 105})
    buckets = histogram_delta(before, after, ("vllm:none", name))
    assert buckets == {0.01: 0, 0.1: 90, 1.0: 100, math.inf: 100}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.01 + 0.09 * 50 / 90)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.1 + 0.9 * 5 / 10)
    assert histogram_quantile({0.1: 0, math.inf: 4}, 0.5) == 0.1  # past the last bound: that bound
    assert histogram_quantile({0.1: 0, math.inf: 0}, 0.5) is None
    assert histogram_delta(before, after, ("vllm:none",)) is None


def test_ngram_acceptance_replays_prompt_lookup():
    context = "a b c d e f".split()
    # the output repeats the context: nothing matches until "a b", whose earlier match drafts "c d e f",
    # all four right, which ends the text
    assert ngram_acceptance(context, "a b c d e f".split()) == (4, 4)
    assert ngram_acceptance(context, "x y z".split()) == (0, 0)
    assert ngram_acceptance(context, "c d x".split()) == (4, 0)  # "c d" drafts "e f c d"; "x" came


ENGINE = {
    "max_num_seqs": "64",
    "max_num_batched_tokens": "512",
    "enable_prefix_caching": "True",
    "capacity_tokens": "2048",
    "max_model_len": "1024",
    "num_kv_blocks": "128",
    "kv_cache_bytes": str(2**28),
    "engine_threads": "2",
    "cpu_count": "2",
    "device": "cpu",
}
WINDOW = {"seconds": 10.0, "preemptions": 0, "waiting_while_full": 0, "peak_running": 4, "peak_waiting": 0}
PROBE = {
    "single_ttft": 0.1,
    "decode_step": 0.01,
    "concurrency": 8,
    "concurrent_ttft_p50": 0.2,
    "concurrent_ttft_max": 0.3,
}


def ids(probe=None, window=None, engine=None, roofline=None) -> set[str]:
    ev = Evidence(
        {**PROBE, **(probe or {})}, {**WINDOW, **(window or {})}, {**ENGINE, **(engine or {})}, roofline or {}
    )
    return {f.id for f in diagnose(ev)}


def test_a_healthy_deployment_gets_no_finding():
    assert ids() == set()


def test_each_rule_fires_on_its_evidence_and_only_there():
    assert ids(window={"preemptions": 3}) == {"kv_pool_too_small"}
    assert ids(window={"waiting_while_full": 2, "peak_kv_usage": 1.0}) == {"kv_pool_too_small"}
    # waiting at the sequence cap with room in the pool; at a full pool it is the pool's finding instead
    seqs = {"peak_running": 1, "peak_waiting": 7, "peak_kv_usage": 0.01}
    assert ids(window=seqs, engine={"max_num_seqs": "1"}) == {"max_num_seqs_too_low"}
    (finding,) = diagnose(Evidence(PROBE, {**WINDOW, **seqs}, {**ENGINE, "max_num_seqs": "1"}))
    assert finding.advice[0].startswith("raise --max-num-seqs to at least 8")  # the 8 the probe sent together
    assert "max_num_seqs_too_low" not in ids(window={**seqs, "peak_kv_usage": 1.0}, engine={"max_num_seqs": "1"})
    shared = {"shared_prefix_tokens": 256, "shared_requests": 3, "shared_cached_tokens": 0}
    assert ids(probe=shared, engine={"enable_prefix_caching": "False"}) == {"prefix_cache_missed"}
    assert ids(probe={**shared, "shared_cached_tokens": 720}) == set()
    # 40 chunks of 16 tokens, each about one decode step: the step's fixed cost dominates
    chunk = {"long_prompt_tokens": 640, "long_ttft": 0.5, "stream_step": 0.012}
    assert ids(probe=chunk, engine={"max_num_batched_tokens": "16"}) == {"prefill_chunk_too_small"}
    assert ids(probe=chunk) == set()  # the same prompt in 2 chunks of 512
    stall = {"long_prompt_tokens": 1000, "long_ttft": 0.5, "stall_during_prefill": 0.45, "stream_step": 0.01}
    assert ids(probe=stall) == {"prefill_interferes_with_decode"}
    assert ids(probe={**stall, "stall_during_prefill": 0.04}) == set()  # interleaved: short gaps
    assert ids(probe={"concurrent_ttft_p50": 2.0}) == {"queueing_beyond_slo"}
    busy = {"cpu_seconds": 9.5}
    assert ids(window=busy, engine={"engine_threads": "1", "cpu_count": "4"}) == {"cpu_threads_idle"}
    assert ids(window={"cpu_seconds": 2.0}, engine={"engine_threads": "1", "cpu_count": "4"}) == set()
    assert ids(window=busy) == set()  # every core has a thread
    assert ids(engine={"huge_pages": "never"}) == {"huge_pages_off"}
    assert ids(engine={"huge_pages": "madvise"}) == set()
    assert ids(engine={"huge_pages": "never", "device": "cuda:0"}) == set()  # a GPU's memory: no such pages


def test_the_roofline_rules_name_quantization_and_speculation_when_decode_reads_at_the_bandwidth():
    decode = {
        "step_seconds": 0.01,
        "bytes_per_step": 1e8,
        "achieved_bytes_per_s": 1e10,
        "machine_bytes_per_s": 1.2e10,
        "share": 0.83,
        "roofline_tokens_per_s": 120,
    }
    ev = Evidence({**PROBE, "ngram_acceptance": 0.6, "ngram_drafted": 50}, WINDOW, ENGINE, {"decode": decode})
    (finding,) = diagnose(ev)
    assert finding.id == "decode_at_bandwidth_roofline"
    assert "83%" in finding.evidence[0] and "60%" in finding.evidence[1]
    assert any("quantization" in a for a in finding.advice) and any('"ngram"' in a for a in finding.advice)
    low = Evidence(PROBE, WINDOW, ENGINE, {"decode": {**decode, "share": 0.2, "achieved_bytes_per_s": 2.4e9}})
    assert [f.id for f in diagnose(low)] == ["decode_below_roofline"]
    prefill = {"tokens_per_s": 900, "achieved_flops_per_s": 6e10, "share": 0.7, "compute": "int8"}
    prefill["machine_flops_per_s"] = 8.6e10
    assert "prefill_compute_bound" in ids(roofline={"prefill": prefill})


def test_roofline_shares_from_model_facts():
    layer = LayerKV(kv_heads=2, head_dim=16, window=None, tensors=2, query_heads=4, value_dim=16)
    facts = ModelFacts("m", "Llama", 1000, 0, 100, 100, 10, True, 0, 0, [layer] * 2, 1024)
    hw = Hardware("hw", "cpu", 1e9, 1e6, {"float32": 1e9, "int8": 2e9})
    d = decode_share(facts, hw, "float32", step_seconds=0.01, batch=1, context=10)
    read = (1000 + 100 + 10) * 4  # projections, the head, norms in float32
    assert d["bytes_per_step"] == read + 10 * facts.kv_bytes_per_token("float16")
    assert d["share"] == pytest.approx(d["bytes_per_step"] / 0.01 / 1e6)
    c = compute_share(facts, hw, "int4", tokens_per_s=1000, context=0)
    assert c["compute"] == "int8" and c["share"] == pytest.approx(1000 * 2 * 1100 / 2e9)


def test_the_server_exports_its_settings_and_its_whole_cpu_time():
    m = ServerMetrics("m")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=3))
    ready = {
        "model_path": "/m.gguf",
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 512,
        "kv_cache_bytes": 4096,
        "block_size": 16,
        "num_blocks": 8,
        "capacity_tokens": 128,
        "num_threads": 2,
    }
    m.set_engine_info(config, ready)
    samples = parse_prometheus(m.render().decode())
    info = engine_info(samples)
    assert info["max_num_seqs"] == "3" and info["capacity_tokens"] == "128" and info["engine_threads"] == "2"
    assert info["enable_prefix_caching"] == "True" and info["model_path"] == "/m.gguf"
    (cpu,) = [s for s in samples if s.name == "tokenmill:server_cpu_seconds_total"]
    assert cpu.value > 0  # this test process has used CPU
