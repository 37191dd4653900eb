"""The web page at `/` (chat playground and live dashboard): the numbers behind the dashboard (pure), then
the page in a real browser (Debian's chromium driven by Playwright) against a live server behind an API
key — a chat streams token by token, the dashboard's tiles and charts fill from the server's metrics —
and through `tokenmill router`, whose page picks a replica.

The server runs a tiny random-weight Qwen3-MoE (so the MoE tile has numbers) with n-gram speculative
decoding and a price per hour. `TOKENMILL_SCREENSHOTS=DIR` saves the two views' screenshots there (the
README's docs/ui-*.png come from `TOKENMILL_SCREENSHOTS=docs`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import make_tiny_model
from test_router import RouterProcess
from test_server_utils import ServerProcess, model_available

from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.ui.stats import UIStats, quantile

KEY = "sesame-7"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium")
needs_model = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")


# ---- the dashboard's numbers (pure) -----------------------------------------------------------------


@pytest.mark.unit
def test_quantile_interpolates_within_the_bucket_like_prometheus():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 8.0), (float("inf"), 10.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * (5 - 2) / 4)  # rank 5 of 10 in (0.1, 0.2]
    assert quantile(0.1, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert quantile(0.99, buckets) == 0.4  # in the +inf bucket: its lower bound
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


@pytest.mark.unit
def test_stats_window_rates_percentiles_cost_and_any_tier_series():
    metrics = ServerMetrics("m", log_requests=False)
    ui = UIStats(metrics.registry, "m", price_per_hour=3.6)
    for seconds in (0.02, 0.02, 0.02, 0.3):
        metrics.ttft.observe(seconds)
    metrics.prompt_tokens.inc(1000)
    metrics.generation_tokens.inc(250)
    engine = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "num_blocks": 8, "num_free_blocks": 6}
    engine |= {"prefix_cache_queries": 40, "prefix_cache_hits": 30, "spec_draft_tokens": 10, "spec_accepted_tokens": 4}
    engine["kv_tiers"] = {"disk": {"hits": 3, "queries": 4}}  # a tier's counters, as the engine reports them
    engine |= {"decode_steps": 40, "decode_step_seconds": 0.8, "prompt_steps": 2, "prompt_step_seconds": 0.5}
    metrics.on_stats(engine)
    s = ui.stats(window=60)

    ttft = s["latency"]["ttft"]
    assert ttft["count"] == 4 and 0.01 < ttft["p50"] <= 0.025 and 0.2 < ttft["p99"] <= 0.3
    assert ttft["mean"] == pytest.approx(0.09)
    assert s["latency"]["itl"]["p50"] is None  # nothing observed
    span = s["window_s"]
    assert span > 0 and s["throughput"]["input_tok_s"] == pytest.approx(1000 / span)
    assert s["requests"] == {"running": 2, "waiting": 1}
    assert s["kv_cache"]["usage"] == 0.25 and s["prefix_cache"]["hit_rate"] == 0.75
    assert s["spec_decode"]["acceptance"] == 0.4
    # $3.60 an hour is $0.001 a second: the window's cost over its tokens, per million
    assert s["cost"]["per_million_output"] == pytest.approx(0.001 * span * 1e6 / 250)
    assert s["prefix_cache"]["tiers"]["disk"]["hit_rate"] == 0.75
    assert s["prefix_cache"]["tiers"]["disk"]["metrics"]["kv_tier_hits_total"]["value"] == 3
    assert s["engine_steps"]["decode"] == {"share": pytest.approx(0.8 / span), "step_s": pytest.approx(0.02)}
    assert s["engine_steps"]["prompt"]["step_s"] == pytest.approx(0.25)
    assert s["moe"] is None and UIStats(metrics.registry, "m").stats()["cost"] is None


# ---- a live server, in the browser ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe")
    make_tiny_model("qwen3-moe", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    args = ("--model", str(directory), "--served-model-name", "tiny-moe", "--num-kv-blocks", "256")
    args += ("--api-key", KEY, "--price-per-hour", "2.5")
    spec = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    srv = ServerProcess(tmp_path_factory.mktemp("web-ui"), *args, *spec, "--log-interval", "0").start()
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def router(tmp_path_factory, server):
    r = RouterProcess(tmp_path_factory.mktemp("web-ui-router"), [server.url]).start()
    try:
        yield r
    finally:
        assert r.stop() == 0, r.log()


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (`make browser` installs it)")
    with playwright.sync_playwright() as p:
        # --no-sandbox: CI runs as root; a container's /dev/shm is often too small for chromium
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


def screenshot(page, name: str) -> None:
    directory = os.environ.get("TOKENMILL_SCREENSHOTS")
    if directory:
        page.screenshot(path=str(Path(directory) / name), full_page=True)


@needs_model
def test_the_page_is_public_its_data_is_behind_the_key(server, router):
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]  # nothing from elsewhere runs
    assert httpx.get(f"{server.url}/ui/app.js", timeout=10).status_code == 200
    refused = httpx.get(f"{server.url}/ui/stats", timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.get(f"{server.url}/ui/stats?window=soon", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "window"
    stats = httpx.get(f"{server.url}/ui/stats", headers=AUTH, timeout=10).json()
    assert stats["model"] == "tiny-moe" and stats["cost"]["price_per_hour"] == 2.5
    # the router: the same page; a replica's numbers, its key check included, and the replica list
    assert httpx.get(f"{router.url}/", timeout=10).text == page.text
    assert httpx.get(f"{router.url}/ui/stats", timeout=10).status_code == 401
    routed = httpx.get(f"{router.url}/ui/stats?replica=0", headers=AUTH, timeout=10).json()
    assert routed["model"] == "tiny-moe" and routed["replicas"][0]["url"] == server.url
    bad = httpx.get(f"{router.url}/ui/stats?replica=1", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "replica"


def wait_until(page, condition: str, timeout: float = 60) -> None:
    """Poll a JavaScript expression until it is true (the page's CSP forbids Playwright's eval-based
    wait_for_function: `evaluate` runs outside it)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):
        if time.monotonic() > deadline:
            pytest.fail(f"not true within {timeout} s: {condition}")
        page.wait_for_timeout(100)


def open_with_key(browser, url: str):
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("#key-form:not([hidden])")  # the first data request got 401
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    wait_until(page, "document.querySelector('#model').options.length > 0")
    return page, errors


def chat(page, text: str) -> dict:
    """Send `text`; wait for the reply. Its text, chunk count, and how many separate moments the reply
    grew while it was still streaming (a reply delivered in one piece grows at one moment)."""
    page.evaluate(
        """() => {
            window.growths = 0;
            new MutationObserver(() => {
                const last = document.querySelector('#messages .bubble.assistant:last-child');
                if (last && last.classList.contains('streaming') && last.querySelector('.text').textContent) window.growths++;
            }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#messages .bubble.assistant:last-child[data-done]", timeout=120_000)
    bubble = page.locator("#messages .bubble.assistant").last
    return {
        "text": bubble.locator(".text").inner_text(),
        "error": "error" in (bubble.get_attribute("class") or ""),
        "chunks": int(bubble.get_attribute("data-chunks")),
        "meta": bubble.locator(".meta").inner_text(),
        "growths": page.evaluate("window.growths"),
    }


def tiles(page) -> dict[str, tuple[str, str]]:
    """The dashboard's tiles: {label: (value, detail)}, read at one moment (a poll between separate reads
    would pair one answer's values with the next one's details)."""
    read = "[...document.querySelectorAll('.tile')].map((t) => ['label', 'value', 'sub'].map((c) => t.querySelector('.' + c).innerText))"
    return {label: (value, detail) for label, value, detail in page.evaluate(read)}


def throttled(bytes_per_second: float) -> dict:
    """DevTools' network conditions: downloads at `bytes_per_second` (-1: as fast as they come)."""
    return {"offline": False, "latency": 0, "downloadThroughput": bytes_per_second, "uploadThroughput": -1}


def complete(server) -> None:
    server.openai_client(KEY).completions.create(
        model="tiny-moe", prompt="one two three one two three one two", max_tokens=16, extra_body={"ignore_eos": True}
    )


@needs_model
def test_a_chat_streams_and_the_dashboard_charts_it(server, browser):
    page, errors = open_with_key(browser, server.url)
    page.fill("#system", "You are terse.")
    page.fill("#max_tokens", "24")
    page.fill("#temperature", "0")
    page.fill("#seed", "7")
    # the reply's bytes reach the page over about three seconds (DevTools' network throttling), so that a
    # browser held off the CPU while the tiny model generates cannot read them all at one moment
    devtools = page.context.new_cdp_session(page)
    devtools.send("Network.enable")
    devtools.send("Network.emulateNetworkConditions", throttled(2000))
    reply = chat(page, "Name three colours, then count to ten.")
    devtools.send("Network.emulateNetworkConditions", throttled(-1))
    assert not reply["error"], reply
    assert reply["chunks"] > 1 and reply["growths"] > 1, reply  # tokens arrived one by one, not at the end
    assert "24 tokens" in reply["meta"] and "tok/s" in reply["meta"]
    curl = page.inner_text("#curl")
    assert f"{server.url}/v1/chat/completions" in curl and '"seed": 7' in curl and '"stream": true' in curl
    assert "Bearer $TOKENMILL_API_KEY" in curl and KEY not in curl  # the key stays off the screen

    page.check("#use-schema")  # structured output itself is tested in test_structured_server.py
    page.fill("#prompt", "Answer in JSON.")
    curl = page.inner_text("#curl")  # the request as it would be sent
    assert '"type": "json_schema"' in curl and '"required": [' in curl and "Answer in JSON." in curl
    screenshot(page, "ui-playground.png")

    page.click("button[data-view=dashboard]")
    shown_before = page.evaluate("samples.length")
    page.select_option("#window", "300")  # the chat above is in it however slow the machine
    wait_until(page, f"samples.length >= {shown_before + 2}")  # the tiles show answers over the 300 s window
    shown = tiles(page)
    assert float(shown["Output tokens / s"][0]) > 0 and float(shown["Input tokens / s"][0]) > 0, shown
    assert shown["TTFT p50 / p99"][0] != "– / –" and shown["MoE load imbalance"][0].endswith("×"), shown
    assert shown["$ per M output tokens"][0].startswith("$") and shown["CPU utilization"][0].endswith("%"), shown
    assert re.fullmatch(r"[\d.]+% / [\d.]+%", shown["Engine time: decode / prompt steps"][0]), shown

    # traffic from another client: the tiles and charts follow it
    before = page.evaluate("samples.length")
    generated = page.evaluate("samples.at(-1).totals.generation_tokens")
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(complete, [server] * 3))
    wait_until(page, f"samples.at(-1).totals.generation_tokens >= {generated + 3 * 16}")
    assert page.evaluate("samples.length") > before
    drawn = "[...document.querySelectorAll('.chart canvas')].every((c) => Number(c.dataset.points) === samples.length)"
    assert page.evaluate(drawn)  # every chart drawn from every answer
    assert tiles(page)["Speculative acceptance"][0].endswith("%")  # the n-gram drafter found repeats
    screenshot(page, "ui-dashboard.png")

    # KV-cache tiers, as /ui/stats gives any series with a tier label (see the unit test above): a table and a line
    tiers = {"disk": {"metrics": {"kv_tier_hits_total": {"value": 3, "rate": 0.5}}, "hit_rate": 0.75}}
    legend = page.evaluate(
        """(tiers) => {
            const s = structuredClone(samples.at(-1));
            s.prefix_cache.tiers = tiers;
            samples.push(s);
            updateTiers(s);
            return CHARTS.find((c) => c.extra).extra(s).map(([name, get]) => [name, get(s)]);
        }""",
        tiers,
    )
    assert legend == [["disk tier hits", 75]]
    assert "disk\t75.0%\tkv_tier_hits_total 3 (0.5/s)" in page.inner_text("#tiers")
    assert errors == []
    page.close()


@needs_model
def test_the_router_page_chats_and_picks_a_replica(router, server, browser):
    page, errors = open_with_key(browser, router.url)
    page.wait_for_selector("#replica-picker:not([hidden])")
    assert page.locator("#replica option").all_inner_texts() == [f"0: {server.url}"]
    page.fill("#max_tokens", "8")
    reply = chat(page, "Hello")
    assert not reply["error"] and reply["chunks"] > 0, reply
    assert errors == []
    page.close()


@needs_model
def test_no_ui_turns_the_page_off(tmp_path, server):
    r = RouterProcess(tmp_path, [server.url], "--no-ui").start()
    try:
        assert httpx.get(f"{r.url}/", timeout=10).status_code == 404
        assert httpx.get(f"{r.url}/ui/stats", headers=AUTH, timeout=10).status_code == 404
    finally:
        assert r.stop() == 0, r.log()
