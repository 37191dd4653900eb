"""`tokenmill bench` pieces without a tokenmill server: metrics math, SLOs, JSON, datasets, /metrics parsing,
plots, and the streaming client against a small canned SSE server on a real socket."""

import asyncio
import json
import math
import os
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from rich.console import Console

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenmill.bench import plots, prometheus, report  # noqa: E402
from tokenmill.bench.cli import add_bench_parser, build_parser, main  # noqa: E402
from tokenmill.bench.client import SKIPPED, EndpointConfig, LoadConfig, arrival_gaps, run_load  # noqa: E402
from tokenmill.bench.datasets import (  # noqa: E402
    DatasetConfig,
    Session,
    Turn,
    build_sessions,
    corpus_text,
    load_bench_tokenizer,
    sample_len,
    transcript,
)
from tokenmill.bench.metrics import (  # noqa: E402
    RequestRecord,
    cost_metrics,
    distribution,
    find_knee,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
    tpot,
)
from tokenmill.bench.runner import RunOptions, make_result, parse_loads, run_serve, run_sweep  # noqa: E402

# ---------------------------------------------------------------------------------------------- percentiles


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n):
    rng = np.random.default_rng(n)
    xs = list(rng.exponential(50.0, n))
    for p in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12, abs=1e-12)


def test_percentile_known_values():
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(xs, 50) == 5.5
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_matches_numpy():
    xs = [0.010, 0.020, 0.025, 0.030, 0.5, 0.012]
    d = distribution(xs, 1000)
    ms = np.array(xs) * 1000
    assert d["count"] == 6
    assert d["mean"] == pytest.approx(ms.mean())
    assert d["median"] == pytest.approx(np.median(ms))
    assert d["std"] == pytest.approx(ms.std())
    for p in (50, 90, 95, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(ms, p))
    assert d["min"] == pytest.approx(10) and d["max"] == pytest.approx(500)
    empty = distribution([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


# ---------------------------------------------------------------------------------------------- TPOT, ITL, summary


def _record(ttft=0.1, gaps=(0.02, 0.02, 0.03), start=0.0, success=True, prompt=10, **kw) -> RequestRecord:
    gaps = list(gaps)
    return RequestRecord(
        success=success,
        start=start,
        ttft=ttft,
        itl=gaps,
        e2e=ttft + sum(gaps),
        prompt_tokens=prompt,
        output_tokens=len(gaps) + 1,
        num_chunks=len(gaps) + 1,
        **kw,
    )


def test_tpot_equals_mean_itl_for_one_token_per_chunk():
    r = _record(ttft=0.2, gaps=[0.01, 0.03, 0.05, 0.02])
    assert r.tpot == pytest.approx(sum(r.itl) / len(r.itl))
    assert tpot(1.0, 0.5, 1) is None  # one token: no TPOT
    assert tpot(1.0, 0.5, 3) == pytest.approx(0.25)
    assert tpot(None, 0.5, 3) is None


def test_summary_counts_throughput_and_goodput():
    records = [
        _record(ttft=0.1, gaps=[0.02] * 4, start=0.0),  # meets the SLO
        _record(ttft=0.9, gaps=[0.02] * 4, start=0.5),  # TTFT too slow
        _record(ttft=0.1, gaps=[0.2] * 4, start=1.0),  # TPOT too slow
        RequestRecord(success=False, error="HTTP 500: boom", start=1.5, e2e=0.05),
        RequestRecord(success=False, error="HTTP 500: boom", start=1.6, e2e=0.05),
    ]
    slo = parse_slo("ttft=500ms,tpot=50ms")
    s = summarize(records, duration=4.0, slo=slo)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["errors"] == {"HTTP 500: boom": 2}
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 15
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(15 / 4)
    assert s["total_token_throughput"] == pytest.approx(45 / 4)
    assert s["goodput"] == pytest.approx(1 / 4)
    assert s["goodput"] <= s["request_throughput"]
    assert s["slo_attainment"] == pytest.approx(1 / 5)
    assert s["achieved_concurrency"] == pytest.approx(sum(r.e2e for r in records) / 4)
    assert s["ttft_ms"]["count"] == 3 and s["itl_ms"]["count"] == 12
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * np.mean([0.02, 0.02, 0.2]))
    assert s["ttft_ms"]["max"] <= s["e2el_ms"]["max"]
    no_slo = summarize(records, 4.0)
    assert no_slo["goodput"] is None and no_slo["slo_attainment"] is None


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_slo("TTFT=250, e2el=1.5s") == {"ttft": 0.25, "e2el": 1.5}
    assert parse_slo("tpot=800us") == {"tpot": pytest.approx(0.0008)}
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft", "latency=5ms", "ttft=fast", "ttft=5min"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_meets_slo():
    slo = {"ttft": 0.5, "tpot": 0.05, "e2el": 1.0}
    assert meets_slo(_record(ttft=0.2, gaps=[0.04] * 3), slo)
    assert not meets_slo(_record(ttft=0.2, gaps=[0.04] * 30), slo)  # e2e 1.4 s
    assert not meets_slo(RequestRecord(success=False, error="x"), slo)
    single = RequestRecord(success=True, ttft=0.1, e2e=0.1, output_tokens=1)
    assert meets_slo(single, slo)  # TPOT is undefined with one token: not held against it


def test_cost_and_knee():
    s = {"duration_s": 3600.0, "total_input_tokens": 2_000_000, "total_output_tokens": 500_000, "completed": 1000}
    c = cost_metrics(4.0, s)
    assert c["run_cost"] == pytest.approx(4.0)
    assert c["per_1m_input_tokens"] == pytest.approx(2.0)
    assert c["per_1m_output_tokens"] == pytest.approx(8.0)
    assert c["per_request"] == pytest.approx(0.004)
    assert cost_metrics(None, s) is None
    points = [{"load": load, "summary": {"slo_attainment": a}} for load, a in ((1, 1.0), (2, 0.95), (4, 0.7), (8, 0.2))]
    assert find_knee(points, 0.9)["load"] == 2
    assert find_knee(points, 0.99)["load"] == 1
    assert find_knee(points, 1.01) is None
    assert parse_loads("1,2, 4,inf") == [1, 2, 4, math.inf]
    with pytest.raises(ValueError):
        parse_loads("1,-2")


# ---------------------------------------------------------------------------------------------- JSON


def _result(records, label="run", kind="serve", load=None) -> dict:
    opts = RunOptions(
        dataset=DatasetConfig(),
        slo=parse_slo("ttft=500ms"),
        cost_per_hour=1.5,
        label=label,
        config={"dataset": "random", "request_rate": math.inf, "max_concurrency": load},
    )
    server = prometheus.cache_delta(
        {"prefix_cache_queries": 10, "prefix_cache_hits": 0, "kv_cache_usage": 0.0},
        {"prefix_cache_queries": 110, "prefix_cache_hits": 5, "kv_cache_usage": 0.1},
    )
    return make_result(kind, opts, records, 2.0, len(records), server, {"server_cpu_percent": None, "gpu": None})


def test_json_round_trip(tmp_path):
    records = [_record(start=0.1 * i, ttft=0.1 + 0.01 * i) for i in range(5)] + [
        RequestRecord(success=False, error="ReadTimeout", start=0.7, e2e=1.0)
    ]
    result = _result(records)
    path = report.write_json(result, tmp_path / "r.json")
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = report.load_json(path)
    assert back["config"]["request_rate"] == "inf"
    assert back["summary"] == json.loads(json.dumps(result["summary"]))
    again = [RequestRecord.from_dict(d) for d in back["requests"]]
    assert again == records
    recomputed = summarize(again, back["summary"]["duration_s"], parse_slo("ttft=500ms"))
    assert recomputed | {"planned_requests": 6} == back["summary"]
    assert back["server_metrics"]["prefix_cache_hit_rate"] == pytest.approx(0.05)
    assert back["cost"]["per_request"] == pytest.approx(1.5 * 2.0 / 3600 / 5)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError):
        report.load_json(tmp_path / "other.json")


# ---------------------------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def tok():
    return load_bench_tokenizer("smollm2-135m-instruct")


def test_corpus_is_real_text():
    text = corpus_text()
    assert len(text) > 100_000
    assert "Beautiful is better than ugly." in text
    assert corpus_text() is text  # built once


def test_sample_len_bounds():
    rng = random.Random(0)
    xs = [sample_len(100, 0.25, rng) for _ in range(2000)]
    assert min(xs) == 75 and max(xs) == 125
    assert {sample_len(100, 0.0, rng) for _ in range(10)} == {100}
    assert min(sample_len(1, 0.9, rng) for _ in range(100)) >= 1


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_random_prompts_have_exact_token_lengths(tok, ratio):
    cfg = DatasetConfig(name="random", num_prompts=30, input_len=64, output_len=16, range_ratio=ratio, seed=3)
    sessions = build_sessions(cfg, tok, chat=False)
    assert len(sessions) == 30
    for s in sessions:
        (turn,) = s.turns
        assert isinstance(turn.content, str)
        assert len(tok.encode(turn.content)) == turn.prompt_len
        lo, hi = (64, 64) if ratio == 0 else (32, 96)
        assert lo <= turn.prompt_len <= hi
    if ratio == 0:
        assert {s.turns[0].output_len for s in sessions} == {16}
    # the same seed gives the same workload; prompts differ from each other
    again = build_sessions(cfg, tok, chat=False)
    assert [s.turns[0].content for s in again] == [s.turns[0].content for s in sessions]
    assert len({s.turns[0].content for s in sessions}) == 30


def test_random_chat_prompts(tok):
    sessions = build_sessions(DatasetConfig(name="random", num_prompts=5, input_len=40, output_len=8), tok, chat=True)
    for s in sessions:
        (msg,) = s.turns[0].content
        assert msg["role"] == "user"
        assert len(tok.encode(msg["content"], add_special_tokens=False)) == 40
        assert s.turns[0].prompt_len == len(tok.encode(tok.render_chat(s.turns[0].content), add_special_tokens=False))


def test_shared_prefix_prompts_share_token_prefixes(tok):
    cfg = DatasetConfig(
        name="shared-prefix", num_prompts=12, num_prefixes=2, prefix_len=100, input_len=20, output_len=4
    )
    sessions = build_sessions(cfg, tok, chat=False)
    ids = [tok.encode(s.turns[0].content) for s in sessions]
    assert all(len(i) == s.turns[0].prompt_len for i, s in zip(ids, sessions))
    heads = {tuple(i[:100]) for i in ids}
    assert len(heads) == 2  # every prompt starts with one of the two prefixes, token for token
    assert all(len(i) >= 120 for i in ids)
    chat = build_sessions(cfg, tok, chat=True)
    systems = [s.turns[0].content[0] for s in chat]
    assert {m["role"] for m in systems} == {"system"} and len({m["content"] for m in systems}) == 2


def test_long_context_mix(tok):
    cfg = DatasetConfig(
        name="long-context",
        num_prompts=10,
        input_len=16,
        output_len=4,
        long_context_len=2000,
        long_context_fraction=0.2,
    )
    lens = [s.turns[0].prompt_len for s in build_sessions(cfg, tok, chat=False)]
    assert sorted(lens) == [16] * 8 + [2000] * 2
    long_prompt = next(s for s in build_sessions(cfg, tok, chat=False) if s.turns[0].prompt_len == 2000)
    assert len(tok.encode(long_prompt.turns[0].content)) == 2000


def test_multi_turn_history(tok):
    cfg = DatasetConfig(name="multi-turn", num_prompts=3, num_turns=3, input_len=12, output_len=4)
    (s, *_) = build_sessions(cfg, tok, chat=True)
    assert s.multi_turn and len(s.turns) == 3
    assert all(len(tok.encode(t.content, add_special_tokens=False)) == 12 for t in s.turns)
    third = s.prompt(2, ["first reply", "second reply"], chat=True)
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "first reply" and third[4]["content"] == s.turns[2].content
    text = s.prompt(1, ["first reply"], chat=False)
    assert text == transcript(
        [
            {"role": "user", "content": s.turns[0].content},
            {"role": "assistant", "content": "first reply"},
            {"role": "user", "content": s.turns[1].content},
        ]
    )
    assert text.endswith("Assistant:")


def test_jsonl_dataset(tok, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 7}\n\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    cfg = DatasetConfig(name="jsonl", num_prompts=3, path=str(path), output_len=5)
    comp = build_sessions(cfg, tok, chat=False)
    assert [s.turns[0].output_len for s in comp] == [7, 5, 7]
    assert comp[0].turns[0].content == "Hello there" and comp[0].turns[0].prompt_len == len(tok.encode("Hello there"))
    assert comp[1].turns[0].content == "User: Hi\n\nAssistant:"
    chat = build_sessions(cfg, tok, chat=True)
    assert chat[0].turns[0].content == [{"role": "user", "content": "Hello there"}]
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        build_sessions(cfg, tok, chat=False)
    with pytest.raises(ValueError):
        DatasetConfig(name="jsonl").validate()


# ---------------------------------------------------------------------------------------------- /metrics

METRICS_TEXT = r"""
# HELP tokenmill:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE tokenmill:prefix_cache_queries_total counter
tokenmill:prefix_cache_queries_total{model_name="m"} 1200.0
tokenmill:prefix_cache_queries_created{model_name="m"} 1.7e9
tokenmill:prefix_cache_hits_total{model_name="m"} 300
# TYPE tokenmill:kv_cache_usage_perc gauge
tokenmill:kv_cache_usage_perc{model_name="m",note="a \"quoted\", {braced} value\\"} 0.25 1712345678000
vllm:prefix_cache_queries_total{model_name="a"} 10
vllm:prefix_cache_queries_total{model_name="b"} 20
histogram_bucket{le="+Inf"} +Inf
nan_gauge NaN
"""


def test_parse_prometheus_text():
    samples = prometheus.parse_prometheus(METRICS_TEXT)
    kv = next(s for s in samples if s.name == "tokenmill:kv_cache_usage_perc")
    assert kv.value == 0.25 and kv.labels == {"model_name": "m", "note": 'a "quoted", {braced} value\\'}
    assert next(s for s in samples if s.name == "histogram_bucket").value == math.inf
    assert math.isnan(next(s for s in samples if s.name == "nan_gauge").value)
    stats = prometheus.cache_stats(samples)
    assert stats == {
        "prefix_cache_queries": 1200.0,
        "prefix_cache_hits": 300.0,
        "kv_cache_usage": 0.25,
        "expert_tokens": {},
        "rank_tokens": {},
        "spec": dict.fromkeys(stats["spec"]),
        "spec_per_position": {},
        "kv_tiers": {},
        "steps": {kind: dict.fromkeys(("steps", "tokens", "seconds")) for kind in ("decode", "prompt")},
    }
    assert prometheus.metric_value(samples, ("vllm:prefix_cache_queries_total",)) == 30
    assert prometheus.metric_value(samples, ("vllm:prefix_cache_queries_total",), model="b") == 20
    assert prometheus.metric_value(samples, ("missing",)) is None
    with pytest.raises(ValueError):
        prometheus.parse_prometheus("not a metric line at all {")


def test_moe_routing_delta_and_imbalance():
    def exposition(counts: dict[str, list[int]]) -> list:
        return prometheus.parse_prometheus(
            "".join(
                f'tokenmill:moe_expert_tokens_total{{model_name="m",layer="{layer}",expert="{e}"}} {n}\n'
                for layer, c in counts.items()
                for e, n in enumerate(c)
            )
        )

    before = prometheus.cache_stats(exposition({"0": [5, 5, 0, 0], "2": [1, 1, 1, 1]}))
    after = prometheus.cache_stats(exposition({"0": [9, 5, 4, 6], "2": [3, 1, 1, 7]}))
    assert after["expert_tokens"]["2"] == {"0": 3.0, "1": 1.0, "2": 1.0, "3": 7.0}
    moe = prometheus.cache_delta(before, after)["moe"]
    # run deltas: layer 0 [4, 0, 4, 6] (max 6 / mean 3.5), layer 2 [2, 0, 0, 6] (6 / 2)
    assert moe["routed_tokens"] == 22 and moe["moe_layers"] == 2
    assert moe["load_imbalance_per_layer"] == pytest.approx([6 / 3.5, 3.0])
    assert moe["load_imbalance_max"] == pytest.approx(3.0)
    assert prometheus.cache_delta(before, before)["moe"] is None  # nothing routed during the run


def test_vllm_names_and_cache_delta():
    samples = prometheus.parse_prometheus(
        "vllm:prefix_cache_queries_total 50\nvllm:prefix_cache_hits_total 5\nvllm:gpu_cache_usage_perc 0.5\n"
    )
    before = prometheus.cache_stats(samples)
    after = {"prefix_cache_queries": 150.0, "prefix_cache_hits": 45.0, "kv_cache_usage": 0.1}
    d = prometheus.cache_delta(before, after, [0.3, 0.9])
    assert d["prefix_cache_queries"] == 100 and d["prefix_cache_hits"] == 40
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert d["kv_cache_usage_max"] == 0.9 and d["exposed"]
    assert prometheus.cache_delta(None, None)["prefix_cache_hit_rate"] is None
    assert prometheus.metrics_url("http://h:1/v1/") == "http://h:1/metrics"
    assert prometheus.metrics_url("http://h:1") == "http://h:1/metrics"


def test_speculative_decoding_counters_and_their_run_delta():
    """tokenmill's counters (and vLLM's names for the counts) become the run's acceptance summary."""

    def text(drafts, tokens, accepted, per_pos, draft_s, verify_s, prefix="tokenmill"):
        lines = [
            f'{prefix}:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
            f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}',
            f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
        ]
        lines += [
            f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{p}"}} {n}'
            for p, n in enumerate(per_pos)
        ]
        if prefix == "tokenmill":
            lines += [
                f'tokenmill:spec_decode_draft_seconds_total{{model_name="m"}} {draft_s}',
                f'tokenmill:spec_decode_verify_seconds_total{{model_name="m"}} {verify_s}',
            ]
        return "\n".join(lines) + "\n"

    before = prometheus.cache_stats(prometheus.parse_prometheus(text(10, 30, 12, [8, 3, 1], 0.5, 4.0)), "m")
    after = prometheus.cache_stats(prometheus.parse_prometheus(text(30, 90, 42, [26, 12, 4], 1.5, 10.0)), "m")
    spec = prometheus.cache_delta(before, after)["spec"]
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (20, 60, 30)
    assert spec["acceptance_rate"] == pytest.approx(0.5) and spec["mean_accepted_length"] == pytest.approx(2.5)
    assert spec["acceptance_per_position"] == pytest.approx([0.9, 0.45, 0.15])
    assert spec["draft_seconds"] == pytest.approx(1.0) and spec["verify_seconds"] == pytest.approx(6.0)
    assert prometheus.cache_delta(before, before)["spec"] is None  # nothing drafted during the run
    vllm = [
        prometheus.cache_stats(prometheus.parse_prometheus(text(*a, prefix="vllm")), "m")
        for a in ((0, 0, 0, [0, 0], 0, 0), (4, 8, 6, [4, 2], 0, 0))
    ]
    spec = prometheus.cache_delta(*vllm)["spec"]
    assert spec["acceptance_per_position"] == pytest.approx([1.0, 0.5]) and "draft_seconds" not in spec
    console = Console(record=True, width=160)
    report.print_run({**_result([_record()]), "server_metrics": {"spec": spec}}, console)
    shown = console.export_text()
    assert "speculative decoding" in shown and "100.0% / 50.0%" in shown


# ---------------------------------------------------------------------------------------------- plots


def _sweep(tmp_path, name) -> dict:
    points = []
    for i, load in enumerate((1, 2, 4)):
        records = [_record(start=0.1 * j, ttft=0.05 * (i + 1) + 0.01 * j, gaps=[0.01 * (i + 1)] * 5) for j in range(6)]
        point = _result(records, label=f"max_concurrency={load}", load=load)
        point["load"] = load
        points.append(point)
    return {
        "tokenmill_bench": 1,
        "kind": "sweep",
        "label": name,
        "sweep_by": "max_concurrency",
        "slo": {"ttft": 500.0},
        "min_slo_attainment": 0.9,
        "knee": {"load": 2},
        "points": points,
        "config": {},
    }


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plots_written(tmp_path):
    run = _result([_record(start=0.1 * i, ttft=0.1 + 0.02 * i, gaps=[0.01, 0.02 + 0.001 * i]) for i in range(8)])
    for path in plots.write_plots(run, tmp_path / "run"):
        assert _is_png(path)
    sweep = _sweep(tmp_path, "a")
    paths = plots.write_plots(sweep, tmp_path / "sw")
    assert [p.name for p in paths] == ["sw_sweep.png", "sw_latency_cdf.png"] and all(map(_is_png, paths))
    assert _is_png(plots.plot_compare([("a", run), ("b", sweep)], tmp_path / "cmp.png"))
    for point in sweep["points"]:  # nothing succeeded: still charts (empty), no crash
        point["requests"] = [RequestRecord(success=False, error="HTTP 503", e2e=0.01).to_dict()] * 3
        point["summary"] = summarize([RequestRecord.from_dict(d) for d in point["requests"]], 1.0, {"ttft": 0.5})
    assert all(_is_png(p) for p in plots.write_plots(sweep, tmp_path / "failed"))


def test_compare_command(tmp_path, capsys):
    a = report.write_json(_result([_record(ttft=0.1)] * 3, label="a"), tmp_path / "a.json")
    b = report.write_json(_sweep(tmp_path, "b"), tmp_path / "b.json")
    c = report.write_json(_sweep(tmp_path, "c"), tmp_path / "c.json")
    main(["compare", str(a), str(b), str(c), "--plot-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "comparison" in out and "requests/s" in out
    for name in ("compare_bars.png", "compare_latency_cdf.png", "compare_sweep.png"):
        assert _is_png(tmp_path / "out" / name)


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_help_lists_flags():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    assert set(sub) == {"serve", "sweep", "compare", "offline"}
    serve_help = sub["serve"].format_help()
    for flag in (
        "--base-url",
        "--model",
        "--endpoint",
        "--tokenizer",
        "--dataset",
        "--num-prompts",
        "--random-input-len",
        "--random-output-len",
        "--random-range-ratio",
        "--request-rate",
        "--burstiness",
        "--max-concurrency",
        "--num-warmups",
        "--timeout",
        "--max-duration",
        "--seed",
        "--ignore-eos",
        "--slo",
        "--server-pid",
        "--cost-per-hour",
        "--result-file",
        "--plot-dir",
        "--disable-tqdm",
        "--num-prefixes",
        "--prefix-len",
        "--num-turns",
        "--long-context-len",
    ):
        assert flag in serve_help, flag
    assert "--concurrencies" in sub["sweep"].format_help() and "--request-rates" in sub["sweep"].format_help()
    assert "--max-num-seqs" in sub["offline"].format_help()  # the engine's own flags
    import argparse

    top = argparse.ArgumentParser(prog="tokenmill")
    add_bench_parser(top.add_subparsers(dest="command"))
    args = top.parse_args(["bench", "serve", "--model", "m", "--slo", "ttft=1s", "--max-concurrency", "3"])
    assert args.func.__name__ == "cmd_serve" and args.max_concurrency == 3 and args.request_rate == math.inf


def test_arrival_gaps():
    assert arrival_gaps(4, math.inf, 1.0, 0) == [0.0] * 4
    for burstiness in (0.5, 1.0, 4.0):
        gaps = arrival_gaps(20000, 10.0, burstiness, seed=1)
        assert gaps[0] == 0.0
        assert np.mean(gaps[1:]) == pytest.approx(0.1, rel=0.05)
        assert np.var(gaps[1:]) == pytest.approx(0.01 / burstiness, rel=0.15)  # gamma: var = k * theta^2
    assert arrival_gaps(10, 2.0, 1.0, 7) == arrival_gaps(10, 2.0, 1.0, 7)


def test_endpoint_payload():
    comp = EndpointConfig("http://h:1/v1", "m", ignore_eos=True, extra_body={"top_p": 0.5})
    assert comp.url == "http://h:1/v1/completions" and not comp.chat
    body = comp.payload("hi", 8)
    assert body["prompt"] == "hi" and body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["top_p"] == 0.5
    chat = EndpointConfig("http://h:1", "m", endpoint="/v1/chat/completions")
    assert chat.url == "http://h:1/v1/chat/completions" and chat.chat
    assert "ignore_eos" not in chat.payload([{"role": "user", "content": "x"}], 4)
    assert chat.payload([{"role": "user", "content": "x"}], 4)["messages"][0]["content"] == "x"


# ---------------------------------------------------------------------------------------------- client vs canned SSE


class _CannedOpenAI(BaseHTTPRequestHandler):
    """Streams "tok0 tok1 ..." as one chunk per token; prompts containing FAIL get HTTP 500, SLOW sleeps,
    NOUSAGE omits the usage chunk."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        chat = self.path.endswith("/chat/completions")
        prompt = json.dumps(body["messages"]) if chat else body["prompt"]
        if "FAIL" in prompt:
            data = b'{"error": {"message": "boom"}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if "SLOW" in prompt:
            threading.Event().wait(3)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] if chat else []
        for i in range(n):
            piece = f" tok{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == n - 1 else None
            events.append({"choices": [choice]})
        if "NOUSAGE" not in prompt:
            usage = {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}
            events.append({"choices": [], "usage": usage})
        for event in [*(json.dumps(e) for e in events), "[DONE]"]:
            payload = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture()
def canned_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CannedOpenAI)
    server.daemon_threads = True
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _sessions(prompts, output_len=5) -> list[Session]:
    return [Session([Turn(p, output_len, 3)]) for p in prompts]


def test_client_records_success_failure_and_fallback(canned_server):
    server, url = canned_server
    cfg = EndpointConfig(url, "m", ignore_eos=True)
    sessions = _sessions(["a", "FAIL please", "NOUSAGE b", "c"])
    records, duration = asyncio.run(
        run_load(sessions, cfg, LoadConfig(max_concurrency=2), lambda t: len(t.split()), progress=False)
    )
    assert len(records) == 4 and duration > 0
    by_prompt = {r.session: r for r in records}
    failed = by_prompt[1]
    assert not failed.success and failed.error.startswith("HTTP 500") and "boom" in failed.error
    for i in (0, 2, 3):
        r = by_prompt[i]
        assert r.success and r.num_chunks == 5 and len(r.itl) == 4 and r.output_tokens == 5
        assert 0 < r.ttft <= r.e2e
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 4)
    assert by_prompt[0].output_tokens_source == "usage" and by_prompt[0].prompt_tokens == 11
    assert by_prompt[2].output_tokens_source == "tokenizer" and by_prompt[2].prompt_tokens == 3
    assert all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in server.bodies)
    s = summarize(records, duration)
    assert s["failed"] == 1 and s["completed"] == 3 and s["total_output_tokens"] == 15


def test_client_timeout_and_max_duration(canned_server):
    _, url = canned_server
    cfg = EndpointConfig(url, "m", timeout=0.5)
    records, _ = asyncio.run(run_load(_sessions(["SLOW", "fast"]), cfg, LoadConfig(), progress=False))
    slow = next(r for r in records if r.session == 0)
    assert not slow.success and slow.error.startswith("timeout")
    cfg = EndpointConfig(url, "m", timeout=30)
    load = LoadConfig(request_rate=1.0, burstiness=1e6, max_duration=1.5)  # arrivals every ~1 s
    records, duration = asyncio.run(run_load(_sessions(["SLOW"] * 5), cfg, load, progress=False))
    assert len(records) < 5  # the later sessions were never sent
    assert records and all(not r.success and r.error.startswith("aborted") for r in records)
    assert duration < 5


def test_multi_turn_sends_growing_history(canned_server):
    server, url = canned_server
    cfg = EndpointConfig(url, "m", endpoint="/v1/chat/completions")
    sessions = [
        Session([Turn("first", 3), Turn("second", 3), Turn("third", 3)], multi_turn=True),
        Session([Turn("FAIL now", 3), Turn("never", 3)], multi_turn=True),
    ]
    records, _ = asyncio.run(run_load(sessions, cfg, LoadConfig(), progress=False))
    conv = sorted((r for r in records if r.session == 0), key=lambda r: r.turn)
    assert [r.success for r in conv] == [True, True, True]
    lengths = sorted(len(b["messages"]) for b in server.bodies if "first" in json.dumps(b["messages"]))
    assert lengths == [1, 3, 5]
    last = max((b for b in server.bodies if "first" in json.dumps(b["messages"])), key=lambda b: len(b["messages"]))
    assert last["messages"][1] == {"role": "assistant", "content": " tok0 tok1 tok2"}
    broken = sorted((r for r in records if r.session == 1), key=lambda r: r.turn)
    assert [r.success for r in broken] == [False, False] and broken[1].error == SKIPPED


def test_run_serve_and_sweep_against_canned_server(canned_server, tok, tmp_path):
    server, url = canned_server
    cfg = EndpointConfig(url, "m", ignore_eos=True)
    opts = RunOptions(
        dataset=DatasetConfig(num_prompts=6, input_len=20, output_len=4),
        tokenizer=tok,
        num_warmups=2,
        slo=parse_slo("ttft=10s"),
        progress=False,
        config={"dataset": "random"},
    )
    result = run_serve(cfg, opts)
    s = result["summary"]
    assert s["completed"] == 6 and s["planned_requests"] == 6 and len(server.bodies) == 8  # 2 warm-ups not counted
    assert all(r["expected_prompt_len"] == 20 for r in result["requests"])
    assert result["server_metrics"]["exposed"] is False  # the canned server has no /metrics
    server.bodies.clear()
    sweep = run_sweep(lambda o: run_serve(cfg, o), opts, [1, 3], "max_concurrency", 0.9)
    assert [p["load"] for p in sweep["points"]] == [1, 3] and sweep["knee"]["load"] == 3
    assert all(p["summary"]["completed"] == 6 for p in sweep["points"])
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 2 + 6 + 6 and not set(prompts[2:8]) & set(prompts[8:])  # each point has its own prompts
    report.write_json(sweep, tmp_path / "sweep.json")
    assert report.load_json(tmp_path / "sweep.json")["knee"]["load"] == 3


def test_kv_tier_hit_rates_over_a_run():
    def exposition(queries: float, hits: float) -> list:
        return prometheus.parse_prometheus(
            f'tokenmill:kv_tier_queries_total{{model_name="m",tier="disk"}} {queries}\n'
            f'tokenmill:kv_tier_hits_total{{model_name="m",tier="disk"}} {hits}\n'
        )

    before, after = prometheus.cache_stats(exposition(100, 40)), prometheus.cache_stats(exposition(300, 190))
    assert after["kv_tiers"] == {"disk": {"queries": 300.0, "hits": 190.0}}
    assert prometheus.cache_delta(before, after)["kv_tiers"] == {
        "disk": {"queries": 200.0, "hits": 150.0, "hit_rate": 0.75}
    }
    console = Console(record=True, width=160)  # what `tokenmill bench` prints of it
    report.print_run({**_result([_record()]), "server_metrics": prometheus.cache_delta(before, after)}, console)
    assert re.search(r"KV disk tier hit rate \(/metrics\) +│ +75\.0% of 200 tokens", console.export_text())


def test_engine_steps_by_kind_over_a_run():
    """tokenmill's step counters become the run's steps per kind, their mean time and share of the run."""

    def exposition(decode: tuple, prompt: tuple) -> list:
        return prometheus.parse_prometheus(
            "".join(
                f'tokenmill:engine_{kind}_{name}_total{{model_name="m"}} {value}\n'
                for kind, values in (("decode", decode), ("prompt", prompt))
                for name, value in zip(("steps", "step_tokens", "step_seconds"), values)
            )
        )

    before = prometheus.cache_stats(exposition((10, 160, 0.2), (2, 800, 0.6)), "m")
    after = prometheus.cache_stats(exposition((110, 1760, 2.2), (6, 2400, 1.8)), "m")
    steps = prometheus.cache_delta(before, after)["steps"]
    assert steps["decode"] == {
        "steps": 100,
        "tokens": 1600,
        "seconds": pytest.approx(2.0),
        "mean_ms": pytest.approx(20),
    }
    assert steps["prompt"]["steps"] == 4 and steps["prompt"]["mean_ms"] == pytest.approx(300)
    assert prometheus.cache_delta(before, before)["steps"]["decode"]["mean_ms"] is None  # no step during the run
    vllm = prometheus.cache_stats(prometheus.parse_prometheus('vllm:prefix_cache_queries_total{model_name="m"} 5\n'))
    assert prometheus.cache_delta(vllm, vllm)["steps"] is None  # a server without the counters
    result = {**_result([_record()]), "server_metrics": {"steps": steps}}
    console = Console(record=True, width=160)
    report.print_run(result, console)
    share = 2.0 / result["summary"]["duration_s"]
    assert re.search(
        rf"decode steps \(newest tokens only\) +│ +100 x 20\.0 ms, 16\.0 tokens each: {100 * share:.1f}% of the run",
        console.export_text(),
    )
