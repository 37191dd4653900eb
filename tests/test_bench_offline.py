"""`tokenmill bench offline`: the engine in-process on the bench workloads (tiny counts; no timing asserts)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenmill.bench import report  # noqa: E402
from tokenmill.bench.cli import main  # noqa: E402
from tokenmill.bench.metrics import RequestRecord  # noqa: E402


def _offline(tmp_path, name, *flags) -> tuple[dict, list[RequestRecord]]:
    path = tmp_path / f"{name}.json"
    main(["offline", "--model", "smollm2-135m-instruct", "--disable-tqdm", "--result-file", str(path), *flags])
    result = report.load_json(path)
    return result, [RequestRecord.from_dict(d) for d in result["requests"]]


def test_offline_random(tmp_path):
    result, records = _offline(
        tmp_path,
        "random",
        "--num-prompts",
        "3",
        "--random-input-len",
        "16",
        "--random-output-len",
        "3",
        "--ignore-eos",
        "--max-concurrency",
        "2",
        "--slo",
        "ttft=60s",
        "--cost-per-hour",
        "1",
    )
    s = result["summary"]
    assert result["kind"] == "offline" and (s["completed"], s["failed"]) == (3, 0)
    assert s["total_input_tokens"] == 48 and s["total_output_tokens"] == 9
    for r in records:
        assert r.prompt_tokens == r.expected_prompt_len == 16 and r.output_tokens == 3
        assert 0 < r.ttft <= r.e2e and len(r.itl) == 2
        # the engine times every token: TPOT is exactly the mean gap
        assert r.tpot == pytest.approx(sum(r.itl) / len(r.itl), rel=1e-6)
    assert 0 < s["achieved_concurrency"] <= 2 + 1e-6
    assert s["goodput"] <= s["request_throughput"]
    assert result["server_metrics"]["prefix_cache_hit_rate"] < 0.05
    # each request's 16 prompt tokens in prompt steps, its 2nd and 3rd tokens' inputs in decode or mixed steps
    steps = result["server_metrics"]["steps"]
    assert steps["prompt"]["tokens"] >= 48 and steps["prompt"]["tokens"] + steps["decode"]["tokens"] == 3 * 18
    assert steps["prompt"]["steps"] >= 2 and steps["decode"]["steps"] >= 1
    assert result["utilization"]["server_cpu_percent"] is not None
    assert (tmp_path / "random_latency_cdf.png").is_file()


def test_offline_multi_turn_chat(tmp_path):
    result, records = _offline(
        tmp_path,
        "multi",
        "--dataset",
        "multi-turn",
        "--chat",
        "--num-prompts",
        "1",
        "--num-turns",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--ignore-eos",
    )
    first, second = sorted(records, key=lambda r: r.turn)
    assert first.success and second.success
    assert second.prompt_tokens > first.prompt_tokens + first.output_tokens  # the history was re-sent
    assert second.start >= first.start + first.e2e - 1e-6
