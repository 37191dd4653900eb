"""A bounded soak: a few hundred mixed requests (good, malformed, oversized, abandoned mid-way) from
eight clients at once against a real server. No 5xx, nothing hangs, afterwards no request is left
running, the KV pool is whole, and the server still answers."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server_utils import MODEL, ServerProcess, metric_values, model_available

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

BODY_LIMIT = 32768
OPENAI_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("soak"),
        "--num-kv-blocks",
        "48",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--max-queue",
        "64",
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--log-interval",
        "0",
        "--disable-log-requests",
    ).start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def _good(rng: random.Random) -> tuple[str, dict]:
    tokens = rng.randint(1, 8)
    if rng.random() < 0.5:
        return "/v1/completions", {
            "model": MODEL,
            "prompt": rng.choice(["Hello", "1, 2, 3,", "def f(x):"]),
            "max_tokens": tokens,
            "temperature": rng.choice([0, 0.8]),
            "stream": rng.random() < 0.5,
            "n": rng.choice([1, 2]),
        }
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": tokens,
        "stream": rng.random() < 0.5,
        "response_format": {"type": "json_object"} if rng.random() < 0.2 else None,
    }


_MALFORMED = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 100000}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * 1000}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "guided_regex": "(a"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "guided_json": '{"a":' * 3000 + "1" + "}" * 3000}).encode()),
    ("/v1/completions", json.dumps({"prompt": [99999999]}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x " * 400}).encode()),  # longer than the context
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
        ).encode(),
    ),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "min_tokens": 500}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
    ("/v1/completions", b"x" * (BODY_LIMIT + 1)),  # oversized body: 413
]


def _one(url: str, i: int) -> tuple[str, int, list[str]]:
    """Send request i; returns (kind, status, finish reasons seen)."""
    rng = random.Random(i)
    kind = rng.choices(["good", "malformed", "abandoned"], weights=[5, 3, 2])[0]
    with httpx.Client(base_url=url, timeout=120) as client:
        if kind == "malformed":
            path, raw = rng.choice(_MALFORMED)
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            return kind, r.status_code, []
        path, body = _good(rng)
        if kind == "abandoned":  # leave after the first bytes (stream) or long before the answer (no stream)
            body = dict(body, max_tokens=120, ignore_eos=True, stream=rng.random() < 0.5)
            try:
                with client.stream("POST", path, json=body, timeout=httpx.Timeout(120, read=0.3)) as r:
                    next(r.iter_bytes())
                    return kind, r.status_code, []
            except httpx.ReadTimeout:
                return kind, 0, []
        r = client.post(path, json={k: v for k, v in body.items() if v is not None})
        reasons = []
        if r.status_code == 200:
            if body["stream"]:
                for line in r.text.splitlines():
                    if line.startswith("data: {"):
                        reasons += [
                            c["finish_reason"]
                            for c in json.loads(line[6:]).get("choices", [])
                            if c.get("finish_reason")
                        ]
            else:
                reasons = [c["finish_reason"] for c in r.json()["choices"]]
        return kind, r.status_code, reasons


def test_soak_mixed_traffic(server):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _one(server.url, i), range(300)))
    statuses = [status for _, status, _ in results]
    assert not [s for s in statuses if s >= 500], sorted(set(statuses))
    good = [(status, reasons) for kind, status, reasons in results if kind == "good"]
    assert all(status in (200, 429) for status, _ in good) and sum(status == 200 for status, _ in good) > 50
    assert all(r in OPENAI_FINISH_REASONS for _, reasons in good for r in reasons)
    assert {s for kind, s, _ in results if kind == "malformed"} <= {400, 404, 413, 429}
    deadline = time.monotonic() + 60  # abandoned requests are aborted as their connections close
    while True:
        m = metric_values(server.url)
        idle = (
            m["tokenmill:num_requests_running"] == 0
            and m["tokenmill:num_requests_waiting"] == 0
            and m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"]
        )
        if idle:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.25)
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()
