"""The router forwards the Responses, Messages (and count_tokens) and embeddings APIs and the LoRA
load / unload routes: two real tiny replicas behind a real `tokenmill router`, through the official
`openai` and `anthropic` clients. Same answers as a replica, streams passed through, the replicas'
key checked (Bearer and x-api-key), each API's own error shape (the router's own errors included), a
`previous_response_id` sent to the replica that stored it, and adapters loaded on every replica."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from helpers import make_lora_adapter, make_tiny_model
from test_router import RouterProcess
from test_server_utils import ServerProcess, model_available

from tokenmill.router.prompt import routing_text
from tokenmill.router.upstream import pinned_replica

needs_model = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

MODEL, KEY = "tiny", "router-key"
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tokenizer):
    """Two keyed replicas with LoRA on, a router in front, and an adapter's directory."""
    root = tmp_path_factory.mktemp("router-apis")
    base = make_tiny_model("llama-gqa-untied", root / "base", vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(root / "base")
    make_lora_adapter(base, root / "adapter", 1, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    args = ("--model", str(root / "base"), "--served-model-name", MODEL, "--num-kv-blocks", "128")
    args += ("--log-interval", "0", "--api-key", KEY, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "4")
    servers = [ServerProcess(root, *args) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        router = RouterProcess(root, [s.url for s in servers], "--health-interval", "0.5").start()
        try:
            yield router, servers, root
        finally:
            assert router.stop() == 0, router.log()
    finally:
        for s in servers:
            s.stop()


def openai_client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def anthropic_client(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def test_routing_text_and_pinning_of_the_new_apis():
    """Responses and Messages route on their system text and conversation, as chat does; embeddings and
    token counts by load; a previous_response_id names its replica when it is one of the list."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    chat = routing_text("/v1/chat/completions", {"messages": messages})
    assert routing_text("/v1/responses", {"instructions": "S", "input": "Hi"}) == chat
    blocks = {"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "Hi"}]}
    assert routing_text("/v1/messages", blocks) == chat == "system:S\x1euser:Hi\x1e"
    assert routing_text("/v1/embeddings", {"input": "Hi"}) is None
    assert routing_text("/v1/messages/count_tokens", blocks) is None
    assert pinned_replica("/v1/responses", {"previous_response_id": "resp_r1_ab"}, 2) == 1
    for path, body in (
        ("/v1/responses", {"previous_response_id": "resp_r2_ab"}),  # not a replica of this router
        ("/v1/responses", {"previous_response_id": "resp_ab"}),  # not tagged
        ("/v1/responses", {"previous_response_id": 7}),
        ("/v1/chat/completions", {"previous_response_id": "resp_r1_ab"}),
    ):
        assert pinned_replica(path, body, 2) is None


@needs_model
def test_responses_stay_with_the_replica_that_stored_them(cluster):
    router, servers, _ = cluster
    via = openai_client(router.url)
    first = via.responses.with_raw_response.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    replica = int(first.headers["x-tokenmill-replica"])
    assert first.parse().id.startswith(f"resp_r{replica}_")
    direct = openai_client(servers[replica].url).responses.create(
        model=MODEL, input="Hello", max_output_tokens=4, temperature=0
    )
    assert first.parse().output_text == direct.output_text and direct.id.startswith("resp_")
    # follow-ups whose own text would route anywhere land where the conversation is stored
    for text in ("And then?", "More.", "Why?"):
        then = via.responses.with_raw_response.create(
            model=MODEL, input=text, previous_response_id=first.parse().id, max_output_tokens=3, temperature=0
        )
        assert int(then.headers["x-tokenmill-replica"]) == replica and then.parse().previous_response_id
    events = list(
        via.responses.create(
            model=MODEL, input="Go on", previous_response_id=first.parse().id, max_output_tokens=4, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    with pytest.raises(openai.AuthenticationError):
        openai_client(router.url, "wrong").responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        via.responses.create(model=MODEL, input="Hi", max_output_tokens=-1)
    assert e.value.body["param"] == "max_output_tokens"


@needs_model
def test_messages_and_count_tokens_through_the_router(cluster):
    router, servers, _ = cluster
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=6, system="Be brief.", extra_body={"temperature": 0})
    message = anthropic_client(router.url).messages.create(**kwargs)
    assert message.content[0].text == anthropic_client(servers[0].url).messages.create(**kwargs).content[0].text
    with anthropic_client(router.url).messages.stream(**kwargs) as stream:
        types = [e.type for e in stream]
        assert stream.get_final_message().content[0].text == message.content[0].text
    assert types[0] == "message_start" and "content_block_delta" in types and types[-1] == "message_stop"
    count = anthropic_client(router.url).messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert count.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(router.url, "wrong").messages.create(**kwargs)
    bearer = {"authorization": f"Bearer {KEY}"}
    bad = httpx.post(f"{router.url}/v1/messages", json={"model": MODEL, "messages": ASK}, headers=bearer)
    assert bad.status_code == 400 and bad.json()["type"] == "error" and "max_tokens" in bad.json()["error"]["message"]
    # the router's own 400 (a body that is not JSON) is in Anthropic's shape too, on OpenAI's routes OpenAI's
    for path, shape in (("/v1/messages/count_tokens", "type"), ("/v1/responses", "error")):
        own = httpx.post(f"{router.url}{path}", content=b"{nope", headers=bearer)
        assert own.status_code == 400 and shape in own.json() and "x-tokenmill-replica" not in own.headers


@needs_model
def test_embeddings_and_lora_adapters_on_every_replica(cluster):
    router, servers, root = cluster
    texts = ["The quick brown fox", "jumps"]
    via = openai_client(router.url).embeddings.create(model=MODEL, input=texts)
    direct = openai_client(servers[1].url).embeddings.create(model=MODEL, input=texts)
    for ours, theirs in zip(via.data, direct.data, strict=True):
        assert ours.embedding == pytest.approx(theirs.embedding, abs=1e-6)
    headers = {"x-api-key": KEY}
    load = {"lora_name": "ad", "lora_path": str(root / "adapter")}
    assert httpx.post(f"{router.url}/v1/load_lora_adapter", json=load, headers=headers).status_code == 200
    for s in servers:
        assert {m.id for m in openai_client(s.url).models.list().data} == {MODEL, "ad"}
    prompt = dict(prompt="Once upon a time", max_tokens=4, temperature=0)
    adapted = openai_client(servers[0].url).completions.create(model="ad", **prompt).choices[0].text
    assert openai_client(router.url).completions.create(model="ad", **prompt).choices[0].text == adapted
    again = httpx.post(f"{router.url}/v1/load_lora_adapter", json=load, headers=headers)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"  # a replica's answer
    unload = httpx.post(f"{router.url}/v1/unload_lora_adapter", json={"lora_name": "ad"}, headers=headers)
    assert unload.status_code == 200
    for s in servers:
        assert {m.id for m in openai_client(s.url).models.list().data} == {MODEL}
    assert httpx.post(f"{router.url}/v1/load_lora_adapter", json=load).status_code == 401
