"""Server limits and failure handling: API key, body size, queue limit, start-up errors, the engine
process dying, and graceful shutdown on SIGTERM/SIGINT without orphan processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server_utils import MODEL, ServerProcess, model_available, wait_gone

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("server"),
        "--api-key",
        KEY,
        "--max-queue",
        "1",
        "--max-num-seqs",
        "1",
        "--num-kv-blocks",
        "64",
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--log-interval",
        "0",
        "--shutdown-timeout",
        "1",
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def completion(url: str, headers: dict | None = AUTH, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def test_api_key_required_on_v1(server):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        r = completion(server.url, headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    bad = server.openai_client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = server.openai_client(api_key=KEY)
    assert good.models.list().data[0].id == MODEL
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    for path in ("/health", "/version", "/metrics"):  # not under /v1: no key needed
        assert httpx.get(f"{server.url}{path}").status_code == 200
    # the admin route is behind the key too
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_oversized_body_gets_413(server):
    big = {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=big, headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    r = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        timeout=60,
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 413
    assert completion(server.url).status_code == 200


def test_queue_full_gets_429(server):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: completion(server.url, max_tokens=12, prompt=f"Story {i}:"), range(8)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, [r.text for r in responses]
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    err = next(r for r in responses if r.status_code == 429).json()["error"]
    assert err["code"] == "queue_full" and "queue" in err["message"]
    assert next(r for r in responses if r.status_code == 429).headers["retry-after"] == "1"
    client = server.openai_client(api_key=KEY)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_startup_errors_exit_cleanly():
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port_holder.listen()
    busy_port = port_holder.getsockname()[1]
    cases = [
        (["--model", "/nonexistent/model.gguf", "--port", "0"], "could not start the engine"),
        (["--port", str(busy_port)], "cannot listen"),
        (["--num-kv-blocks", "0"], "num_blocks"),
    ]
    try:
        for args, words in cases:
            r = subprocess.run(
                [sys.executable, "-m", "tokenmill.server.cli", "serve", *args],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode != 0
            assert words in r.stderr, r.stderr
            assert "Traceback" not in r.stderr, r.stderr
    finally:
        port_holder.close()


def test_sigterm_aborts_in_flight_and_stops_core(server):
    """Runs last in this module: it shuts the module's server down. With --shutdown-timeout 1 the
    long request in flight is aborted after the drain window."""
    core = server.core_pid()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120)
    start = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log()
    reader.join(30)
    assert not reader.is_alive()
    assert time.monotonic() - start < 30
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert len(events) < 300
    assert wait_gone(core), "engine core outlived the server"
    log = server.log()
    assert "received SIGTERM" in log and "server stopped" in log
    assert "Traceback" not in log, log


def test_the_template_timeout_counts_from_when_the_work_starts():
    """A request's prompt work that waits for the pool behind other requests' (here: work holding both of
    its threads for twice the timeout) is not refused for that wait; its own time still counts."""
    import asyncio

    from tokenmill.http_front import APIError
    from tokenmill.server.limits import RequestLimits
    from tokenmill.server.serving import ServingContext

    ctx = ServingContext(None, None, [], 64, 64, 100, limits=RequestLimits(template_timeout=0.5))
    release = threading.Event()

    async def scenario():
        busy = [asyncio.ensure_future(ctx.off_loop("prompt", release.wait, 30)) for _ in range(2)]
        quick = asyncio.ensure_future(ctx.off_loop("prompt", lambda: "done"))  # third in the pool's queue
        await asyncio.sleep(1.0)  # twice the timeout
        release.set()
        assert await quick == "done"
        for outcome in await asyncio.gather(*busy, return_exceptions=True):  # they ran past it themselves
            assert isinstance(outcome, APIError) and "longer than 0.5 s" in outcome.message, outcome

    try:
        asyncio.run(scenario())
    finally:
        release.set()
