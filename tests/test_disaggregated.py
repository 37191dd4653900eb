"""Disaggregated prefill/decode: two engine cores in this process (producer and consumer, each
connector) against one engine, token for token; then a producer (prefill) and a consumer (decode)
`tokenmill serve` behind `tokenmill disagg-proxy`, with each KV connector, against colocated serving — greedy outputs
identical through the official `openai` client, streamed or not; the KV really moved (the transfer
counters of both sides); KV pools whole afterwards; bad flags refused at startup naming the field;
a consumer whose producer is gone fails the request, saying so, instead of hanging.

Real processes on 127.0.0.1, a tiny random-weight Llama with the default model's tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import make_core, make_tiny_model
from test_router import client_for, kill_tree, needs_model, tiny_model, wait_for  # noqa: F401 - tiny_model: a fixture
from test_server_utils import ServerProcess, free_port, healthy, metric_values

from tokenmill.engine.core import EngineCore, RequestRejected
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import UniProcExecutor
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.proxy import prefill_body, transferable
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

SERVER_ARGS = (
    "--served-model-name",
    "tiny",
    "--num-kv-blocks",
    "128",
    "--log-interval",
    "0",
    "--disable-log-requests",
    "--shutdown-timeout",
    "5",
)
CONNECTORS = ("TorchDistributedConnector", "SharedMemoryConnector")
PROMPTS = ["The tariff table lists four zones and their prices for parcels. " * 4, "Name three colours."]
CHAT = [{"role": "user", "content": "Say something about parcels and zones, at length."}]


# ---- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "role, text, message",
    [
        ("producer", "{not json", "not valid JSON"),
        ("producer", '{"kv_conector": "SharedMemoryConnector"}', "unknown field(s) kv_conector"),
        ("producer", '{"kv_connector": "Nixl"}', "kv_connector must be one of"),
        ("consumer", '{"kv_rank": 0}', "kv_rank must be 1 for a consumer"),
        ("producer", '{"kv_parallel_size": 4}', "kv_parallel_size must be 2"),
        ("producer", '{"kv_port": 70000}', "kv_port must be a TCP port"),
        ("producer", '{"kv_timeout": 0}', "kv_timeout must be a positive"),
        ("producer", '{"kv_role": "consumer"}', "contradicts --kv-role producer"),
        (None, '{"kv_port": 1234}', "--kv-role (producer or consumer) is required"),
    ],
)
def test_bad_kv_transfer_config_names_the_field(role, text, message):
    with pytest.raises(ValueError, match="--kv-transfer-config|--kv-role") as e:
        KVTransferConfig.from_args(role, text)
    assert message in str(e.value)


def test_bad_kv_transfer_config_is_a_startup_error():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.server.cli",
            "serve",
            "--kv-role",
            "consumer",
            "--kv-transfer-config",
            '{"kv_connector": "Bogus"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert (
        "--kv-transfer-config: kv_connector must be one of TorchDistributedConnector, SharedMemoryConnector"
        in run.stderr
    )


# ---- two engine cores in this process --------------------------------------------------------------


def _core(model_dir, role: str | None, connector: str = "", port: int = 0, kv_timeout: float = 2):
    """An engine core on its own copy of the model (a model binds the KV cache of the last core built on it)."""
    core = make_core(str(model_dir), num_blocks=48, max_num_batched_tokens=32, loaded=load_model(str(model_dir)))
    if role is None:
        return core
    transfer = KVTransferConfig(role, connector, kv_port=port, kv_timeout=kv_timeout)
    config = dataclasses.replace(core.config, kv_transfer=transfer)
    return EngineCore(config, UniProcExecutor(config, load_model(str(model_dir))), set())


def _run(core, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    core.add_request(EngineCoreRequest(request_id, prompt, params))
    tokens, error = [], None
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            error = error or out.error
    return tokens, error


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-random")
    make_tiny_model("llama-gqa-untied", directory)
    return directory


@pytest.mark.parametrize("connector", CONNECTORS)
def test_engines_decode_from_transferred_kv_as_one_engine_would(random_model, connector):
    """Prompts over several blocks, prefilled in chunks (32 tokens a step), one exactly a block long;
    the consumer's greedy tokens equal one engine's; aborts on either side hold nothing; a transfer
    the producer never had fails the request; pools whole on both sides."""
    port = free_port()
    reference, producer, consumer = (
        _core(random_model, None),
        *(_core(random_model, role, connector, port) for role in ("producer", "consumer")),
    )
    params = SamplingParams(max_tokens=10, temperature=0.0)
    for i, prompt in enumerate([list(range(5, 90)), list(range(40, 56)), [7, 9]]):
        tid = dataclasses.replace(params, kv_transfer_id=f"t{i}")
        expected, _ = _run(reference, f"r{i}", prompt, params)
        first, _ = _run(producer, f"r{i}", prompt, tid)
        assert first == expected[:1]  # the producer stops after one token
        assert _run(consumer, f"r{i}", prompt, tid) == (expected, None)
    assert consumer.stats().kv_transfers == producer.stats().kv_transfers == 3
    assert consumer.stats().prefix_cache_hits == 84 + 15 + 1  # each prompt but its last token came by transfer
    # aborted mid-prefill (producer) and while waiting for its KV (consumer): nothing is held
    producer.add_request(
        EngineCoreRequest("cut", list(range(5, 90)), dataclasses.replace(params, kv_transfer_id="cut"))
    )
    consumer.add_request(
        EngineCoreRequest("cut", list(range(5, 90)), dataclasses.replace(params, kv_transfer_id="cut"))
    )
    producer.step()
    consumer.step()
    for core in (producer, consumer):
        core.abort_requests(["cut"])
        assert not core.has_unfinished()
    tokens, error = _run(consumer, "lost", [1, 2, 3], dataclasses.replace(params, kv_transfer_id="never-sent"))
    assert tokens == [] and "never-sent" in error
    for core in (producer, consumer):
        assert core.kv.num_free_blocks == core.kv.num_blocks
        core.executor.kv_connector.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_transfer_that_never_comes_holds_no_other_up(random_model, connector):
    """A consumer asked for a transfer id the producer never had (a client may send any) keeps asking
    for it until kv_timeout (a minute here), but a real transfer asked after it comes through meanwhile;
    aborting the waiting request stops its fetch and frees its blocks."""
    port = free_port()
    producer, consumer = (
        _core(random_model, role, connector, port, kv_timeout=60) for role in ("producer", "consumer")
    )
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = list(range(5, 60))
    first, _ = _run(producer, "real", prompt, dataclasses.replace(params, kv_transfer_id="real"))
    consumer.add_request(EngineCoreRequest("bogus", prompt, dataclasses.replace(params, kv_transfer_id="invented")))
    consumer.step()  # its fetch is asked first
    consumer.add_request(EngineCoreRequest("real", prompt, dataclasses.replace(params, kv_transfer_id="real")))
    tokens, errors = {"real": [], "bogus": []}, {}
    while not (len(tokens["real"]) == 6 or errors):
        for out in consumer.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error:
                errors[out.request_id] = out.error
    assert not errors and tokens["real"][:1] == first and tokens["bogus"] == []  # served while the other waits
    assert consumer.has_unfinished()
    consumer.abort_requests(["bogus"])
    assert not consumer.has_unfinished()
    assert consumer.kv.num_free_blocks == consumer.kv.num_blocks
    for core in (producer, consumer):
        core.executor.kv_connector.close()


def test_a_plain_engine_refuses_a_transfer(random_model):
    core = _core(random_model, None)
    with pytest.raises(RequestRejected, match="--kv-role") as e:
        core.add_request(EngineCoreRequest("x", [1, 2], SamplingParams(kv_transfer_id="t")))
    assert e.value.param == "kv_transfer_params"


def test_the_proxy_prefills_one_token_and_passes_the_rest_to_decode():
    body = {
        "prompt": "hi",
        "max_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert prefill_body(body, "t") == {
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"transfer_id": "t"},
    }
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, "t")
    assert chat["max_completion_tokens"] == chat["max_tokens"] == 1
    assert transferable(body) and transferable({"prompt": [1, 2, 3]}) and transferable({"messages": []})
    assert not transferable({"prompt": ["a", "b"]}) and not transferable({"prompt": "a", "n": 2})
    assert not transferable(None)


# ---- servers --------------------------------------------------------------------------------------


class ProxyProcess:
    def __init__(self, prefill: str, decode: str, log_dir) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"proxy-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tokenmill.entrypoints.cli",
                    "disagg-proxy",
                    "--prefill",
                    prefill,
                    "--decode",
                    decode,
                    "--port",
                    str(self.port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module", params=CONNECTORS)
def disaggregated(request, tmp_path_factory, tiny_model):  # noqa: F811 - the imported fixture
    """A producer, a consumer and the proxy in front, over `request.param`."""
    log_dir = tmp_path_factory.mktemp(request.param)
    config = json.dumps({"kv_connector": request.param, "kv_port": free_port(), "kv_timeout": 10})
    producer, consumer = (
        ServerProcess(
            log_dir, "--model", str(tiny_model), *SERVER_ARGS, "--kv-role", role, "--kv-transfer-config", config
        )
        for role in ("producer", "consumer")
    )
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ServerProcess.start, (producer, consumer)))
    proxy = ProxyProcess(producer.url, consumer.url, log_dir)
    wait_for(lambda: healthy(proxy.url), 60, proxy.log)
    yield producer, consumer, proxy
    proxy.proc.terminate()
    proxy.proc.wait(10)
    for server in (producer, consumer):
        server.stop()


def _answers(url: str) -> list[str]:
    """Greedy answers: completions (plain and streamed) and a streamed chat."""
    client = client_for(url)
    out = []
    for prompt in PROMPTS:
        out.append(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        out.append("".join(c.choices[0].text for c in stream))
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, stream=True)
    out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return out


def _pool_whole(url: str) -> bool:
    m = metric_values(url)
    return m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"]


@needs_model
def test_greedy_output_through_the_proxy_equals_colocated(disaggregated):
    """The reference: the consumer itself serving the requests colocated (no kv_transfer_params: it
    prefills them as a plain server does)."""
    producer, consumer, proxy = disaggregated
    expected = _answers(consumer.url)
    assert all(expected) and expected[0] == expected[1]
    assert _answers(proxy.url) == expected
    for server in (producer, consumer):  # the KV really moved: every request's prompt, in and out
        wait_for(lambda s=server: metric_values(s.url).get("tokenmill:kv_transfers_total") == 5, 30, server.log)
        assert metric_values(server.url)["tokenmill:kv_transfer_bytes_total"] > 0
        wait_for(lambda s=server: _pool_whole(s.url), 30, server.log)


@needs_model
def test_a_consumer_whose_producer_is_gone_fails_the_request(disaggregated):
    producer, consumer, proxy = disaggregated
    kill_tree(producer.proc)
    client = client_for(consumer.url)
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="producer"):
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=8,
            temperature=0,
            extra_body={"kv_transfer_params": {"transfer_id": "gone"}},
        )
    assert time.monotonic() - start < 20  # at most the transfer's timeout (10 s), never a hang
    wait_for(lambda: _pool_whole(consumer.url), 30, consumer.log)
    # the proxy says which server failed
    with pytest.raises(openai.APIStatusError, match="prefill server"):
        client_for(proxy.url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8)
