"""The OpenAI-compatible server, end to end: a real `tokenmill serve` subprocess, driven with the
official `openai` client (sync and async) and raw httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from test_server_utils import MODEL, ServerProcess, metric_values, model_available, sse_events, wait_gone

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

NUM_BLOCKS = 160
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Name another one."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the exact mode: these tests compare outputs across batchings, streaming and prefix hits
    srv = ServerProcess(
        tmp_path_factory.mktemp("server"),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--log-interval",
        "1",
    ).start()
    try:
        core = srv.core_pid()
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
    assert wait_gone(core), "the engine core process outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def wait_for_idle(url: str, timeout: float = 30) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(url)
        idle = (
            m["tokenmill:num_requests_running"] == 0
            and m["tokenmill:num_requests_waiting"] == 0
            and m["tokenmill:num_free_kv_blocks"] == NUM_BLOCKS
            and m["tokenmill:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---- basic endpoints --------------------------------------------------------------------------------


def test_health_version_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    log = server.log()
    assert "KV cache 160 blocks x 16 tokens = 2560 tokens" in log and "ready in" in log
    assert f"http://127.0.0.1:{server.port}" in log


def test_tokenize_detokenize(server, tokenizer):
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPT
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT)


# ---- completions ------------------------------------------------------------------------------------


def test_completion_usage_matches_tokenizer(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert isinstance(r.created, int)
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text.strip()
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_forms_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello, my name is"], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello, my name is"))
    assert batch.usage.completion_tokens == 10


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    prompt = " ".join(f"item{i}" for i in range(60)) + ". Summarize:"
    before = metric_values(server.url)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    salted = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-b"}
    )
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].text == first.choices[0].text
    after = metric_values(server.url)
    assert after["tokenmill:prefix_cache_queries_total"] - before["tokenmill:prefix_cache_queries_total"] == 3 * n
    assert after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"] == cached

    def delta(name):
        return after[f"tokenmill:engine_{name}_total"] - before[f"tokenmill:engine_{name}_total"]

    # each request: its prompt (less what was cached) in prompt steps, then one decode step for its second token
    assert delta("prompt_step_tokens") == 3 * n - cached and delta("prompt_steps") >= 3
    assert delta("decode_steps") == 3 and delta("decode_step_tokens") == 3
    assert delta("decode_step_seconds") > 0 and delta("prompt_step_seconds") > 0

    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json()["blocks_dropped"] > 0
    third = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == first.choices[0].text


def test_n2_and_seeds_reproduce(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=1234, **kwargs)
    b = client.completions.create(seed=1234, **kwargs)
    c = client.completions.create(seed=99, **kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.usage.completion_tokens == 20 and a.usage.prompt_tokens == b.usage.prompt_tokens
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert a.choices[0].text != a.choices[1].text  # each sample gets its own seed


def test_stop_sequences(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    # a stop string that first occurs part-way through the greedy output (" Paris.\n\nThe answer ...")
    stop = next(
        full[i : i + 3]
        for i in range(3, len(full) - 3)
        if full[i : i + 3].strip() and full[i : i + 3] not in full[: i + 2]
    )
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@@"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(logprob)  # greedy: the pick is the top-1
        assert max(top.values()) == pytest.approx(logprob)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)


# ---- chat -------------------------------------------------------------------------------------------


def test_chat_multi_turn_stream_and_not(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(CHAT))
    assert r.usage.completion_tokens <= 10
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_n2_stream_and_logprobs(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, n=2, seed=5, temperature=0.8, stream=True
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and bytes(item.bytes).decode() == item.token
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


# ---- concurrency and cancellation ------------------------------------------------------------------


def test_32_concurrent_streams(server):
    prompts = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(32)]

    async def run() -> list[tuple[str, str, int]]:
        aclient = server.openai_client(asynchronous=True)

        async def one(prompt: str) -> tuple[str, str, int]:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, finish, usage

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert all(finish == "length" and n == 12 and text for text, finish, n in results)
    assert len({text for text, _, _ in results}) == 32
    # the same prompts as one batched non-streaming request give the same greedy texts
    ref = httpx.post(
        f"{server.url}/v1/completions",
        timeout=300,
        json={"model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    ).json()
    ref_texts = [c["text"] for c in sorted(ref["choices"], key=lambda c: c["index"])]
    matches = sum(a == b for (a, _, _), b in zip(results, ref_texts))
    assert matches >= 30, list(zip([r[0] for r in results], ref_texts))
    wait_for_idle(server.url)


def test_disconnect_mid_stream_frees_blocks(server):
    before = metric_values(server.url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            busy = metric_values(server.url)
            assert busy["tokenmill:num_requests_running"] == 1
            assert busy["tokenmill:num_free_kv_blocks"] < NUM_BLOCKS
    start = time.monotonic()
    after = wait_for_idle(server.url, timeout=20)
    assert after["tokenmill:num_free_kv_blocks"] == NUM_BLOCKS, after
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    assert time.monotonic() - start < 20
    assert (
        after['tokenmill:request_success_total{finished_reason="abort"}']
        >= before.get('tokenmill:request_success_total{finished_reason="abort"}', 0) + 1
    )
    # far fewer than 400 tokens were generated for it
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 300


def test_disconnect_non_streaming_frees_blocks(server):
    before = metric_values(server.url)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    after = wait_for_idle(server.url, timeout=20)
    assert after["tokenmill:num_free_kv_blocks"] == NUM_BLOCKS, after
    assert (
        after['tokenmill:request_success_total{finished_reason="abort"}']
        >= before.get('tokenmill:request_success_total{finished_reason="abort"}', 0) + 1
    )


# ---- errors -----------------------------------------------------------------------------------------

LONG_PROMPT = "hello " * 600  # > MAX_MODEL_LEN tokens

ERROR_CASES = [
    # (path, raw body or JSON, status, param, words in the message)
    ("/v1/completions", b'{"model": "x", "prompt": ', 400, None, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "object"),
    ("/v1/completions", b"", 400, None, "empty"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "required"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": -1}, 400, "temperature", "must be in [0, "),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 0}, 400, "n", "n must"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "logprobs": 99}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt", "string"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "token"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt", "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 600}, 400, "max_tokens", "context length"),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model", "gpt-4"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        "role",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "content",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model", "nope"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "seed": 2**70}, 400, "seed", "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "cache_salt": ""}, 400, "cache_salt", "cache_salt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "vocabulary"),
]


@pytest.mark.parametrize(
    "path,body,status,param,words", ERROR_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ERROR_CASES)]
)
def test_bad_requests_get_openai_errors(server, path, body, status, param, words):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{server.url}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    assert "Traceback" not in r.text and 'File "' not in r.text


def test_errors_through_openai_client_then_normal_request(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---- metrics and logs -------------------------------------------------------------------------------

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
]


def test_metrics_move_after_traffic(server, client):
    before = metric_values(server.url)
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ] + [f"{h}_count" for h in HISTOGRAMS]:
        assert f"tokenmill:{name}" in before, name
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    after = metric_values(server.url)
    for h in HISTOGRAMS:
        assert after[f"tokenmill:{h}_count"] >= before[f"tokenmill:{h}_count"] + 1, h
    assert (
        after["tokenmill:inter_token_latency_seconds_count"]
        >= before["tokenmill:inter_token_latency_seconds_count"] + 4
    )
    assert after["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 5
    key = 'tokenmill:request_success_total{finished_reason="length"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["tokenmill:time_to_first_token_seconds_sum"] > before["tokenmill:time_to_first_token_seconds_sum"]
    assert after["tokenmill:num_kv_blocks"] == NUM_BLOCKS


def test_log_lines(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "throughput:" not in server.log():
        time.sleep(0.2)
    log = server.log()
    assert "throughput:" in log and "KV cache" in log
    finished = [line for line in log.splitlines() if " finished: " in line]
    assert finished and "TTFT" in finished[-1] and "TPOT" in finished[-1] and "reason length" in finished[-1]
    assert "Traceback" not in log, log
