"""Data parallelism: the routing policies (pure), then two real tiny replicas behind a real
`tokenmill router` (same outputs as a replica, prefix affinity, failures), a replica that drops
connections (one retry elsewhere), and `tokenmill serve --data-parallel-size 2` end to end.

The replicas serve a tiny random-weight Llama with the default model's tokenizer (it loads in
seconds); they are started once for the module, and the tests that kill them run last."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from helpers import make_tiny_model
from test_server_utils import (
    ServerProcess,
    free_port,
    metric_values,
    model_available,
    wait_gone,
)

from tokenmill.router.policy import (
    AFFINITY,
    BALANCED,
    ROUND_ROBIN,
    LeastLoadPolicy,
    PrefixPolicy,
    PrefixTable,
    RoundRobinPolicy,
    chunk_keys,
    make_policy,
)
from tokenmill.router.prompt import routing_text

MODEL = "tiny"
REPLICA_ARGS = (
    "--served-model-name",
    MODEL,
    "--num-kv-blocks",
    "256",
    "--log-interval",
    "0",
    "--disable-log-requests",
    "--shutdown-timeout",
    "5",
)
PREFIX = (
    "You are a careful assistant for a shipping company. Answer briefly, cite the tariff table, never "
    "invent surcharges, and ask for the parcel weight when it is missing. The tariff table: zone A 4.10, "
    "zone B 5.30, zone C 7.95, zone D 11.20; parcels over 20 kg pay double; islands add 3.00. "
) * 2
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
TIMEOUT = 120

needs_model = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")


# ---- the policies (pure) --------------------------------------------------------------------------


def test_chunk_keys_are_paths_of_a_prefix_tree():
    a, b = chunk_keys("x" * 64 + "y" * 40, 32), chunk_keys("x" * 64 + "z" * 32, 32)
    assert len(a) == 3 and len(b) == 3  # the trailing partial chunk has no key
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chunk_keys("y" * 32 + "x" * 32, 32)[1] != a[1]  # a key depends on every chunk before it
    assert chunk_keys("short", 32) == []


def test_prefix_policy_follows_the_longest_match():
    policy = PrefixPolicy(3, match_threshold=0.5, chunk_chars=8)
    policy.tables[0].insert(chunk_keys("A" * 40, 8))
    policy.tables[1].insert(chunk_keys("A" * 64, 8))
    d = policy.choose([0, 1, 2], [0, 0, 0], "A" * 64 + "question")
    assert (d.replica, d.kind) == (1, AFFINITY) and d.match == pytest.approx(64 / 72)
    assert policy.choose([0, 2], [0, 0, 0], "A" * 64 + "question").replica == 0  # 1 unhealthy: the next best
    # the chosen replica records the text at once: the same prompt follows it
    assert policy.match_fraction(0, "A" * 64 + "question") == 1.0


def test_prefix_policy_below_the_threshold_is_least_load():
    policy = PrefixPolicy(2, match_threshold=0.5, chunk_chars=8)
    policy.tables[0].insert(chunk_keys("B" * 16, 8))
    d = policy.choose([0, 1], [0, 3], "B" * 16 + "-" * 24)  # 16 of 40 characters match: 0.4 < 0.5
    assert (d.replica, d.kind) == (0, BALANCED)
    d = policy.choose([0, 1], [2, 0], "C" * 40)  # nothing matches anywhere
    assert (d.replica, d.kind) == (1, BALANCED)
    assert policy.choose([0, 1], [0, 1], None).kind == BALANCED  # no routing text
    relaxed = PrefixPolicy(2, match_threshold=0.3, chunk_chars=8)
    relaxed.tables[1].insert(chunk_keys("B" * 16, 8))
    assert relaxed.choose([0, 1], [0, 3], "B" * 16 + "-" * 24).kind == AFFINITY


def test_prefix_policy_falls_back_to_least_load_when_imbalanced():
    policy = PrefixPolicy(2, match_threshold=0.5, balance_threshold=4, chunk_chars=8)
    policy.tables[0].insert(chunk_keys("D" * 64, 8))
    assert policy.choose([0, 1], [4, 0], "D" * 64).kind == AFFINITY  # a difference of 4 is still balanced
    d = policy.choose([0, 1], [6, 1], "D" * 64)
    assert (d.replica, d.kind) == (1, BALANCED)
    assert policy.match_fraction(1, "D" * 64) == 1.0  # recorded where it went


def test_prefix_policy_with_a_shared_tier_routes_what_every_replica_can_load_by_load():
    for shared, expected in ((False, (0, AFFINITY)), (True, (1, BALANCED))):
        policy = PrefixPolicy(2, match_threshold=0.5, chunk_chars=8, shared_tier=shared)
        assert policy.choose([0, 1], [0, 0], "E" * 64).replica == 0
        d = policy.choose([0, 1], [1, 0], "E" * 64 + "same burst")  # not answered yet: where it is computed
        assert (d.replica, d.kind) == (0, AFFINITY)
        policy.answered("E" * 64)
        d = policy.choose([0, 1], [3, 0], "E" * 64 + "next turn")  # on disk for both: the idle one
        assert (d.replica, d.kind) == expected
    first = policy.choose([0, 1], [0, 0], "F" * 64).replica  # no record anywhere: in turn
    policy.answered("F" * 64)
    for _ in range(2):  # loadable by both; a tie of load: the one whose pool has it
        d = policy.choose([0, 1], [0, 0], "F" * 64)
        assert (d.replica, d.kind) == (first, BALANCED)


def test_prefix_policy_sends_equal_prefixes_together_and_spreads_the_rest():
    policy = PrefixPolicy(2, chunk_chars=16)
    prefixes = [f"system prompt number {i}: " * 8 for i in range(4)]
    first = {p: policy.choose([0, 1], [0, 0], p + "first question").replica for p in prefixes}
    assert set(first.values()) == {0, 1}  # ties of load go round in turn
    for p in prefixes:
        for q in range(3):
            d = policy.choose([0, 1], [0, 0], p + f"question {q}")
            assert (d.replica, d.kind) == (first[p], AFFINITY)


def test_round_robin_goes_in_turn_over_the_candidates():
    policy = RoundRobinPolicy(3)
    assert [policy.choose([0, 1, 2], [0, 0, 0], "x").replica for _ in range(4)] == [0, 1, 2, 0]
    assert [policy.choose([0, 2], [9, 0, 0], None).replica for _ in range(3)] == [2, 0, 2]  # load is ignored
    assert policy.choose([1], [0, 0, 0], None).kind == ROUND_ROBIN


def test_least_load_picks_the_fewest_in_flight():
    policy = LeastLoadPolicy(3)
    assert policy.choose([0, 1, 2], [3, 1, 2], "x").replica == 1
    assert policy.choose([0, 2], [3, 0, 2], "x").replica == 2
    assert [policy.choose([0, 1, 2], [1, 0, 0], None).replica for _ in range(4)] == [1, 2, 1, 2]  # ties in turn
    with pytest.raises(ValueError):
        policy.choose([], [0, 0, 0], None)


def test_prefix_table_is_lru_bounded_and_evicts_leaves_first():
    table = PrefixTable(max_chunks=4)
    a, b = chunk_keys("a" * 24, 8), chunk_keys("b" * 16, 8)  # 3 and 2 chunks
    table.insert(a)
    assert table.match(a) == 3
    table.insert(b)  # 5 > 4: the least recently used goes, and that is a's deepest chunk
    assert len(table) == 4 and table.match(a) == 2 and table.match(b) == 2
    table.insert(a)  # touching a again makes b the oldest
    assert table.match(a) == 3 and table.match(b) == 1
    bounded = PrefixPolicy(1, chunk_chars=8, table_chars=8 * 10)
    for i in range(50):
        bounded.choose([0], [0], f"{i:08d}" * 4)
    assert len(bounded.tables[0]) == 10
    bounded.forget(0)
    assert len(bounded.tables[0]) == 0


def test_make_policy_checks_its_options():
    assert isinstance(make_policy("prefix", 2), PrefixPolicy)
    assert make_policy("round-robin", 2).name == "round-robin"
    for bad in ({"name": "nope"}, {"match_threshold": 1.5}, {"balance_threshold": -1}):
        with pytest.raises(ValueError):
            make_policy(**{"name": "prefix", "num_replicas": 2, **bad})


def test_routing_text_of_completions_and_chat():
    assert routing_text("/v1/completions", {"prompt": "Hello"}) == "Hello"
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3 "
    assert routing_text("/v1/completions", {"prompt": ["a", "b"]}) == "a\x1eb"
    assert routing_text("/v1/completions", {"prompt": {}}) is None
    short = {"messages": CHAT[:1]}
    longer = {"messages": CHAT + [{"role": "assistant", "content": [{"type": "text", "text": "Red"}]}]}
    a, b = routing_text("/v1/chat/completions", short), routing_text("/v1/chat/completions", longer)
    assert a == "system:You are terse.\x1e" and b.startswith(a) and b.endswith("assistant:Red\x1e")


# ---- two tiny replicas behind a router ------------------------------------------------------------


class RouterProcess:
    """`python -m tokenmill.entrypoints.cli router ...` on a free port."""

    def __init__(self, log_dir: Path, urls: list[str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        replicas = [a for u in urls for a in ("--replica", u)]
        self.cmd = [
            sys.executable,
            "-m",
            "tokenmill.entrypoints.cli",
            "router",
            *replicas,
            "--port",
            str(self.port),
            *args,
        ]
        self.log_path = Path(log_dir) / f"router-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, ready_status: int = 200) -> RouterProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")
            )
        wait_for(lambda: _status(f"{self.url}/health") == ready_status, 120, self.log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                pytest.fail(f"the router did not stop on SIGTERM:\n{self.log()}")
        return self.proc.returncode


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def wait_for(condition, timeout: float, log=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s\n{log()}")
        time.sleep(0.1)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a server and its engine core (as a crash would leave them)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(10)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    assert all(wait_gone(c.pid) for c in children)


def client_for(url: str, timeout: float = TIMEOUT) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def routed(router_url: str) -> dict[str, float]:
    """Router requests by replica URL (every decision summed)."""
    counts: dict[str, float] = {}
    for key, value in metric_values(router_url).items():
        if key.startswith("tokenmill:router_requests_total{"):
            replica = key.split('replica="')[1].split('"')[0]
            counts[replica] = counts.get(replica, 0) + value
    return counts


def prefix_counters(url: str) -> tuple[float, float]:
    m = metric_values(url)
    return m["tokenmill:prefix_cache_queries_total"], m["tokenmill:prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama-gqa-untied", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    """Two replicas and a router (prefix policy) in front of them."""
    log_dir = tmp_path_factory.mktemp("router-cluster")
    servers = [ServerProcess(log_dir, "--model", str(tiny_model), *REPLICA_ARGS) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        router = RouterProcess(log_dir, [s.url for s in servers], "--health-interval", "0.5").start()
        try:
            yield router, servers
        finally:
            assert router.stop() == 0, router.log()
    finally:
        for s in servers:
            s.stop()


@needs_model
def test_completions_through_the_router_match_a_replica(cluster):
    router, servers = cluster
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    direct = client_for(servers[0].url).completions.create(**body).choices[0].text
    via = client_for(router.url).completions.create(**body)
    assert via.choices[0].text == direct and via.model == MODEL
    chunks = list(client_for(router.url).completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one block


@needs_model
def test_chat_through_the_router_matches_a_replica(cluster):
    router, servers = cluster
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    direct = client_for(servers[1].url).chat.completions.create(**body).choices[0].message.content
    assert client_for(router.url).chat.completions.create(**body).choices[0].message.content == direct
    chunks = list(client_for(router.url).chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct


@needs_model
def test_models_health_and_client_errors_pass_through(cluster):
    router, servers = cluster
    assert [m.id for m in client_for(router.url).models.list().data] == [MODEL]
    health = httpx.get(f"{router.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["healthy_replicas"] == 2
    bad = {"model": MODEL, "prompt": "Hi", "max_tokens": "four"}
    direct = httpx.post(f"{servers[0].url}/v1/completions", json=bad, timeout=10)
    via = httpx.post(f"{router.url}/v1/completions", json=bad, timeout=10)
    assert direct.status_code == via.status_code == 400 and via.json() == direct.json()
    unknown = httpx.post(f"{router.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    assert httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=10).status_code == 400


@needs_model
def test_requests_sharing_a_prefix_go_to_one_replica(cluster):
    router, servers = cluster
    client = client_for(router.url)
    before, cache_before = routed(router.url), [prefix_counters(s.url) for s in servers]
    for i in range(4):
        client.completions.create(
            model=MODEL, prompt=PREFIX + f"Question {i}: how much for 3 kg to zone B?", max_tokens=2, temperature=0
        )
    after, cache_after = routed(router.url), [prefix_counters(s.url) for s in servers]
    sent = [after.get(s.url, 0) - before.get(s.url, 0) for s in servers]
    assert sorted(sent) == [0, 4], sent
    target = sent.index(4)
    queries = [a[0] - b[0] for a, b in zip(cache_after, cache_before)]
    hits = [a[1] - b[1] for a, b in zip(cache_after, cache_before)]
    assert queries[1 - target] == 0 and hits[target] > 0.5 * queries[target]  # 3 of 4 reuse the prefix
    m = metric_values(router.url)
    assert m[f'tokenmill:router_requests_total{{decision="affinity",replica="{servers[target].url}"}}'] >= 3


@needs_model
def test_different_prefixes_spread_over_both_replicas(cluster):
    router, servers = cluster
    client = client_for(router.url)
    before = routed(router.url)
    for i in range(4):
        prefix = f"Conversation {i} about topic number {i * 17}. " * 12
        for q in range(2):
            client.completions.create(model=MODEL, prompt=prefix + f"Question {q}?", max_tokens=2, temperature=0)
    after = routed(router.url)
    sent = [after.get(s.url, 0) - before.get(s.url, 0) for s in servers]
    assert sent == [4, 4], sent  # two prefixes each, both questions of a prefix together


@needs_model
def test_a_client_that_leaves_mid_stream_stops_the_generation(cluster):
    router, servers = cluster
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up

    def idle() -> bool:
        in_flight = sum(
            v for k, v in metric_values(router.url).items() if k.startswith("tokenmill:router_requests_in_flight")
        )
        return in_flight == 0 and all(metric_values(s.url)["tokenmill:num_requests_running"] == 0 for s in servers)

    wait_for(idle, 3)  # 1000 tokens would take far longer: the replica aborted it


def _answer_health(handler: http.server.BaseHTTPRequestHandler) -> None:
    """A fake replica's /health: 200, {"status": "ok"}."""
    body = b'{"status": "ok"}'
    handler.send_response(200)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def dropping_replica():
    """A fake replica: healthy, but it drops every generation request's connection without answering."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            _answer_health(self)

        def do_POST(self):
            self.close_connection = True
            self.connection.shutdown(2)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.handle_error = lambda request, address: None  # the dropped connections' broken pipes
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def answering_replica():
    """A fake replica: healthy; a completion whose prompt says "fail" gets a 500, any other a canned answer."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(200, b'{"status": "ok"}')

        def do_POST(self):
            failed = b"fail" in self.rfile.read(int(self.headers["content-length"]))
            self.answer(500 if failed else 200, b'{"error": {}}' if failed else b'{"choices": [{"text": "ok"}]}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_shared_tier_record_learns_a_prefix_once_a_replica_answered_it(answering_replica):
    from starlette.testclient import TestClient

    from tokenmill.router.app import RouterSettings, build_router_app

    policy = PrefixPolicy(1, chunk_chars=8, shared_tier=True)
    answered, failed = "tool definitions, resent every turn " * 3, "fail " + "x" * 60
    with TestClient(build_router_app([answering_replica], policy, RouterSettings(ui=False))) as client:
        for prompt, status in ((failed, 500), (answered, 200)):
            r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == status
    assert policy.shared.match(chunk_keys(answered, 8)) == len(answered) // 8  # on disk for every replica
    assert policy.shared.match(chunk_keys(failed, 8)) == 0 < policy.tables[0].match(chunk_keys(failed, 8))


@pytest.fixture
def freezing_replica():
    """A fake replica that freezes on its first generation request: /health answers until then, and after
    it nothing answers at all (as a stopped process: connections open, no bytes). A streamed request gets
    its headers and one event first. Yields (url, posts: the generation requests it got)."""
    frozen, thawed, posts = threading.Event(), threading.Event(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if frozen.is_set():
                thawed.wait(60)
                return
            _answer_health(self)

        def do_POST(self):
            posts.append(self.rfile.read(int(self.headers["content-length"])))
            if b'"stream": true' in posts[-1] or b'"stream":true' in posts[-1]:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                event = b'data: {"choices": [{"text": "first"}]}\n\n'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            frozen.set()
            thawed.wait(60)
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", posts
    thawed.set()
    server.shutdown()
    server.server_close()


def _router_test_client(urls: list[str]):
    """An in-process router over `urls` (round-robin) that checks health every 0.2 s, 2 s a check at most."""
    from starlette.testclient import TestClient

    from tokenmill.router.app import RouterSettings, build_router_app

    settings = RouterSettings(ui=False, health_interval=0.2, health_timeout=2.0)
    return TestClient(build_router_app(urls, RoundRobinPolicy(len(urls)), settings))


def _within(seconds: float, fn):
    """fn() on another thread; fails the test if it is still waiting after `seconds`."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=seconds)


def test_a_request_on_a_replica_that_stops_answering_is_given_up(freezing_replica):
    url, posts = freezing_replica
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
    with _router_test_client([url]) as client:
        r = _within(60, lambda: client.post("/v1/completions", json=body))
        assert r.status_code == 503, r.text  # the only replica failed: no one else to retry on
        assert "replica 0 failed: it stopped answering" in r.json()["error"]["message"]
        assert len(posts) == 1
        r = _within(60, lambda: client.post("/v1/messages", json={**body, "messages": []}))
        assert r.status_code == 503 and r.json()["type"] == "error"  # unhealthy now: Anthropic's shape


def test_a_stream_from_a_replica_that_stops_answering_ends_with_an_error_event(freezing_replica):
    url, posts = freezing_replica
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "stream": True}
    with _router_test_client([url]) as client:
        r = _within(60, lambda: client.post("/v1/completions", json=body))
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "first"  # what came before the stall is passed on
    error = json.loads(events[-1])["error"]
    assert error["code"] == "replica_failed" and "stopped answering" in error["message"]


def test_a_request_on_a_replica_that_stops_answering_is_retried_elsewhere(freezing_replica, answering_replica):
    url, posts = freezing_replica
    with _router_test_client([url, answering_replica]) as client:
        r = _within(60, lambda: client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1}))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert len(posts) == 1  # round-robin sent it to the frozen replica first


@needs_model
def test_a_replica_that_fails_before_answering_is_retried_elsewhere(cluster, dropping_replica, tmp_path):
    _, servers = cluster
    router = RouterProcess(tmp_path, [dropping_replica, servers[0].url], "--policy", "round-robin").start()
    try:
        client = client_for(router.url)
        texts = {
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0].text
            for _ in range(4)
        }
        assert len(texts) == 1  # every request served, by the real replica
        m = metric_values(router.url)
        # round-robin's turn comes back to the dropping replica first each time: every request retried once
        assert m[f'tokenmill:router_retries_total{{replica="{dropping_replica}"}}'] == 4
        assert m[f'tokenmill:router_replica_healthy{{replica="{dropping_replica}"}}'] == 1  # it answers /health
        assert m[f'tokenmill:router_requests_total{{decision="round_robin",replica="{servers[0].url}"}}'] == 4
    finally:
        assert router.stop() == 0, router.log()


@needs_model
def test_serve_data_parallel_end_to_end(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        "--model",
        str(tiny_model),
        *REPLICA_ARGS,
        "--data-parallel-size",
        "2",
        "--port",
        str(port),
        "--policy",
        "least-load",
    ]
    log_path = tmp_path / "dp.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for(lambda: _status(f"{url}/health") == 200 or proc.poll() is not None, 240, log_path.read_text)
        assert proc.poll() is None, log_path.read_text()
        tree = psutil.Process(proc.pid).children(recursive=True)
        servers = [c for c in tree if "tokenmill.router.launcher" in " ".join(c.cmdline())]
        assert len(servers) == 2
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # each replica pinned to its own half of the cores
            shares = sorted(s.cpu_affinity() for s in servers)
            assert len(shares[0]) == len(cores) // 2 and not set(shares[0]) & set(shares[1])
        client = client_for(url)
        texts = [
            client.completions.create(model=MODEL, prompt=f"Count {i}:", max_tokens=4, temperature=0).choices[0].text
            for i in range(4)
        ]
        assert len(texts) == 4
        m = metric_values(url)
        assert sum(v for k, v in m.items() if k.startswith("tokenmill:router_replica_healthy")) == 2
        assert sorted(v for k, v in m.items() if k.startswith("tokenmill:router_requests_total")) == [2, 2]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log_path.read_text()
    assert all(wait_gone(p.pid) for p in tree), "replica processes outlived the router"
    assert "stopping the replicas" in log_path.read_text()


# ---- failures (these kill the module's replicas: keep them last) ----------------------------------


@needs_model
def test_a_dead_replica_gets_no_requests(cluster):
    router, servers = cluster
    client = client_for(router.url, timeout=30)
    kill_tree(servers[0].proc)
    before = routed(router.url).get(servers[1].url, 0)
    for i in range(3):  # the first may still be routed to the dead one: refused, retried on the other
        prompt = PREFIX + f"After the crash, question {i}"
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).choices
    assert routed(router.url).get(servers[1].url, 0) - before == 3
    wait_for(
        lambda: metric_values(router.url)[f'tokenmill:router_replica_healthy{{replica="{servers[0].url}"}}'] == 0, 10
    )
    health = httpx.get(f"{router.url}/health", timeout=10).json()
    assert health["healthy_replicas"] == 1
    assert [r["healthy"] for r in health["replicas"]] == [False, True]


@needs_model
def test_no_healthy_replica_is_a_quick_503(cluster):
    router, servers = cluster
    kill_tree(servers[1].proc)
    client = client_for(router.url, timeout=10)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:  # routed before the check noticed, or refused: 503 either way
        client.completions.create(model=MODEL, prompt="Anyone there?", max_tokens=2)
    assert e.value.status_code == 503
    error = e.value.response.json()["error"]
    assert error["code"] == "no_healthy_replica" and error["type"] == "service_unavailable" and error["message"]
    with pytest.raises(openai.APIStatusError) as e:
        list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True))
    assert e.value.status_code == 503
    assert time.monotonic() - start < 5
    wait_for(lambda: _status(f"{router.url}/health") == 503, 10)
    health = httpx.get(f"{router.url}/health", timeout=5)
    assert health.json()["error"]["code"] == "no_healthy_replica"
    m = metric_values(router.url)
    assert m["tokenmill:router_unavailable_total"] >= 2
    assert sum(v for k, v in m.items() if k.startswith("tokenmill:router_replica_healthy")) == 0


def test_replicas_on_one_kv_cache_dir_get_the_shared_tier_policy():
    """`router --shared-kv-tier` and `serve --data-parallel-size N --kv-cache-dir D` build the prefix policy
    with the table every replica can load from; without either (or with another policy) there is none."""
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.router.cli import _policy

    def shared(*argv: str):
        args = build_parser(argv[0]).parse_args(list(argv))
        return getattr(_policy(args, 2)[0], "shared", None) is not None

    assert shared("router", "--replica", "http://a", "--replica", "http://b", "--shared-kv-tier")
    assert not shared("router", "--replica", "http://a", "--replica", "http://b")
    assert shared("serve", "--data-parallel-size", "2", "--kv-cache-dir", "/tmp/kv")
    assert not shared("serve", "--data-parallel-size", "2")
    assert not shared("serve", "--data-parallel-size", "2", "--kv-cache-dir", "/tmp/kv", "--policy", "least-load")
