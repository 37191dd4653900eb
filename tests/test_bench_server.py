"""`tokenmill bench` against the real tokenmill server (started here as a subprocess), small counts.

Checks consistency, not speed: every metric present, TTFT <= E2E, TPOT ~ mean ITL, token counts equal the
server's usage and its own /metrics counters, goodput <= throughput, prefix-cache hit rate ~ 0 for
`random`, failed requests counted with their error, the JSON round-trips and the plots are written.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server_utils import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenmill.bench import prometheus, report  # noqa: E402
from tokenmill.bench.cli import main as bench_main  # noqa: E402
from tokenmill.bench.metrics import RequestRecord, parse_slo, percentile, summarize  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, pid) of a tokenmill server on a free port; its log goes to a file shown on failure."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        "--model",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _counters(url: str) -> dict:
    samples = prometheus.parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
    return {
        name: prometheus.metric_value(samples, (f"tokenmill:{name}_total",))
        for name in ("prompt_tokens", "generation_tokens")
    }


def _bench(url: str, tmp_path: Path, name: str, *flags: str) -> dict:
    result_file = tmp_path / f"{name}.json"
    bench_main(
        ["serve", "--base-url", url, "--model", MODEL, "--disable-tqdm", "--result-file", str(result_file), *flags]
    )
    return report.load_json(result_file)


def _check_consistent(
    result: dict, tmp_path: Path, name: str, input_len: int | None, output_len: int, max_concurrency: int
) -> list[RequestRecord]:
    s = result["summary"]
    records = [RequestRecord.from_dict(d) for d in result["requests"]]
    ok = [r for r in records if r.success]
    assert s["completed"] == len(ok) and s["failed"] == len(records) - len(ok)
    for r in ok:
        assert r.output_tokens_source == "usage"  # the server streamed usage (stream_options.include_usage)
        assert r.output_tokens == output_len and r.finish_reason == "length"  # --ignore-eos
        if input_len is not None:
            assert r.prompt_tokens == r.expected_prompt_len == input_len  # exact prompt lengths
        assert 0 < r.ttft <= r.e2e
        assert 1 <= r.num_chunks <= r.output_tokens and len(r.itl) == r.num_chunks - 1
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / (r.output_tokens - 1))
        assert sum(r.itl) <= r.e2e - r.ttft + 1e-9
        if r.num_chunks == r.output_tokens:  # one chunk per token: TPOT is the mean gap plus the stream's tail
            assert r.tpot == pytest.approx(sum(r.itl) / len(r.itl), rel=0.25)
    assert s["total_output_tokens"] == sum(r.output_tokens for r in ok)
    assert s["total_input_tokens"] == sum(r.prompt_tokens for r in ok)
    assert s["duration_s"] > 0 and s["request_throughput"] == pytest.approx(len(ok) / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert 0 < s["achieved_concurrency"] <= max_concurrency + 1e-6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = s[key]
        assert d["count"] > 0
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"]
        assert d["median"] == d["p50"]
    assert s["ttft_ms"]["p50"] == pytest.approx(percentile([1000 * r.ttft for r in ok], 50))
    assert s["goodput"] is not None and 0 <= s["goodput"] <= s["request_throughput"]
    # the JSON holds everything needed to recompute the summary
    slo = parse_slo(result["config"]["slo"])
    assert summarize(records, s["duration_s"], slo) | {"planned_requests": s["planned_requests"]} == s
    assert (tmp_path / f"{name}_latency_cdf.png").stat().st_size > 5000
    return records


def test_random_workload(server, tmp_path):
    url, pid = server
    before = _counters(url)
    result = _bench(
        url,
        tmp_path,
        "random",
        "--dataset",
        "random",
        "--num-prompts",
        "8",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--slo",
        "ttft=30s,tpot=5s",
        "--server-pid",
        str(pid),
        "--cost-per-hour",
        "1.0",
    )
    after = _counters(url)
    records = _check_consistent(result, tmp_path, "random", 32, 8, 4)
    s = result["summary"]
    assert s["completed"] == 8 and s["failed"] == 0 and s["planned_requests"] == 8
    # the bench's token counts are the server's own
    assert after["generation_tokens"] - before["generation_tokens"] == s["total_output_tokens"] == 64
    assert after["prompt_tokens"] - before["prompt_tokens"] == s["total_input_tokens"] == 256
    server_metrics = result["server_metrics"]
    assert server_metrics["exposed"]
    assert server_metrics["prefix_cache_queries"] > 0
    assert server_metrics["prefix_cache_hit_rate"] is not None and server_metrics["prefix_cache_hit_rate"] < 0.05
    for key in ("kv_cache_usage_before", "kv_cache_usage_after", "kv_cache_usage_max"):
        assert 0 <= server_metrics[key] <= 1
    cpu = result["utilization"]["server_cpu_percent"]
    assert cpu is not None and cpu["samples"] > 0 and cpu["mean"] >= 0
    main = result["utilization"]["server_main_cpu_percent"]  # the front end, without its engine core child
    assert main["samples"] == cpu["samples"] and 0 < main["mean"] <= cpu["mean"]
    assert result["cost"]["per_request"] > 0 and result["cost"]["per_1m_output_tokens"] > 0
    assert "api_key" not in result["config"]
    assert len({r.session for r in records}) == 8


def test_price_server_cpu_and_the_roofline_line(server, tmp_path, monkeypatch):
    """No --server-pid: the server's CPU comes from its /metrics; the roofline line sets the figures
    against the hardware record `tokenmill plan` keeps (a fake one here) and the model's file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    record = tmp_path / "tokenmill" / "hardware.json"
    record.parent.mkdir()
    hw = {"name": "fake", "kind": "cpu", "memory_bytes": 8e9, "bandwidth": 2e10, "flops": {"int8": 2e11}, "source": "t"}
    record.write_text(json.dumps(hw))
    url, _ = server
    flags = ("--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos")
    result = _bench(url, tmp_path, "priced", *flags, "--max-concurrency", "2", "--price-per-hour", "3.6")
    s, cpu = result["summary"], result["utilization"]["server_cpu"]
    assert result["cost"]["cost_per_hour"] == 3.6
    assert result["cost"]["per_request"] == pytest.approx(3.6 * s["duration_s"] / 3600 / 4)
    assert cpu["source"].startswith("the server's /metrics (front end") and cpu["cores_busy"] > 0
    assert cpu["share_of_this_machine"] == pytest.approx(cpu["cores_busy"] / os.cpu_count())  # found by its port
    roofline = result["roofline"]
    assert roofline["hardware"] == "fake" and roofline["weight_format"] == "file"
    decode = roofline["decode"]
    assert decode["share"] == pytest.approx(decode["bytes_per_step"] / (s["tpot_ms"]["median"] / 1e3) / 2e10)
    throughput = roofline["throughput"]
    assert throughput["compute"] == "int8"
    assert throughput["share"] == pytest.approx(s["total_token_throughput"] * throughput["flops_per_token"] / 2e11)


def test_shared_prefix_workload_through_tokenmill_cli(server, tmp_path):
    """Through the top-level `tokenmill bench serve`, as a user would run it."""
    url, _ = server
    result_file = tmp_path / "shared.json"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        MODEL,
        "--dataset",
        "shared-prefix",
        "--num-prompts",
        "8",
        "--num-prefixes",
        "2",
        "--prefix-len",
        "64",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--num-warmups",
        "1",
        "--slo",
        "ttft=30s",
        "--disable-tqdm",
        "--result-file",
        str(result_file),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "requests/s" in proc.stdout and "TTFT" in proc.stdout
    result = report.load_json(result_file)
    _check_consistent(result, tmp_path, "shared", None, 8, 4)
    s = result["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    records = [RequestRecord.from_dict(d) for d in result["requests"]]
    # each prompt is a 64-token prefix + "\n\n" + a 32-token question, exactly as the server counted it
    assert all(r.prompt_tokens == r.expected_prompt_len for r in records)
    assert {r.prompt_tokens for r in records} <= {64 + n + 32 for n in (0, 1, 2)}
    rate = result["server_metrics"]["prefix_cache_hit_rate"]
    assert rate is not None and 0 < rate <= 1, "the shared prefixes should hit the server's prefix cache"


def test_failed_requests_are_counted(server, tmp_path):
    """A prompt longer than the server's context is rejected: counted as failed with the server's error."""
    url, _ = server
    result = _bench(
        url,
        tmp_path,
        "long",
        "--dataset",
        "long-context",
        "--num-prompts",
        "3",
        "--long-context-fraction",
        "0.34",
        "--long-context-len",
        str(MAX_MODEL_LEN + 200),
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--ignore-eos",
        "--slo",
        "ttft=30s",
    )
    s = result["summary"]
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    (error,) = s["errors"]
    assert error.startswith("HTTP 4"), error
    failed = next(r for r in result["requests"] if not r["success"])
    assert failed["expected_prompt_len"] == MAX_MODEL_LEN + 200 and failed["ttft"] is None
    assert s["goodput"] <= s["request_throughput"] and s["slo_attainment"] <= 2 / 3


def test_multi_turn_chat(server, tmp_path):
    url, _ = server
    result = _bench(
        url,
        tmp_path,
        "multi",
        "--endpoint",
        "/v1/chat/completions",
        "--dataset",
        "multi-turn",
        "--num-prompts",
        "2",
        "--num-turns",
        "2",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--ignore-eos",
        "--slo",
        "ttft=30s",
    )
    records = _check_consistent(result, tmp_path, "multi", None, 4, 2)
    assert result["summary"]["completed"] == 4
    for session in (0, 1):
        first, second = sorted((r for r in records if r.session == session), key=lambda r: r.turn)
        # turn 2 re-sends turn 1 and its reply: its prompt is longer than turn 1's prompt plus reply
        assert second.prompt_tokens > first.prompt_tokens + first.output_tokens
        assert second.start >= first.start + first.e2e - 1e-6


def test_result_json_is_standard(server, tmp_path):
    """Written with --request-rate (finite) and read back with the plain json module."""
    url, _ = server
    result = _bench(
        url,
        tmp_path,
        "rate",
        "--num-prompts",
        "3",
        "--random-input-len",
        "16",
        "--random-output-len",
        "2",
        "--request-rate",
        "5",
        "--burstiness",
        "0.5",
        "--seed",
        "4",
    )
    raw = json.loads((tmp_path / "rate.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert raw == result and raw["config"]["request_rate"] == 5.0
    assert raw["summary"]["goodput"] is None  # no --slo
    starts = sorted(r["start"] for r in raw["requests"])
    assert starts[0] < starts[-1]  # Poisson arrivals, not all at once


def test_sweep(server, tmp_path):
    url, _ = server
    result_file = tmp_path / "sweep.json"
    bench_main(
        [
            "sweep",
            "--base-url",
            url,
            "--model",
            MODEL,
            "--concurrencies",
            "1,2",
            "--num-prompts",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "3",
            "--ignore-eos",
            "--slo",
            "ttft=60s",
            "--disable-tqdm",
            "--result-file",
            str(result_file),
        ]
    )
    sweep = report.load_json(result_file)
    assert sweep["kind"] == "sweep" and [p["load"] for p in sweep["points"]] == [1, 2]
    for point in sweep["points"]:
        assert point["summary"]["completed"] == 2
        assert point["summary"]["achieved_concurrency"] <= point["load"] + 1e-6
    assert sweep["knee"] is None or sweep["knee"]["load"] in (1, 2)
    for name in ("sweep_sweep.png", "sweep_latency_cdf.png"):
        assert (tmp_path / name).stat().st_size > 5000
