"""Hostile and careless input against a real server: every bad request is a 400 naming the field,
answered at once, with nothing of the server's internals in it, and everyone else keeps being
served. The server runs with small limits and an operator chat template."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_utils import MODEL, ServerProcess, model_available

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# SmolLM2's template without its default system turn, plus a refusal written for users (raise_exception)
# and a bug (an index past the end) that must not be echoed
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] == 'forbidden' %}{{ raise_exception('this template refuses forbidden words') }}"
    "{% endif %}{% if message['role'] == 'system' and message['content'] == 'crash' %}"
    "{{ messages[99]['content'].upper() }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hardening")
    (directory / "template.jinja").write_text(TEMPLATE)
    srv = ServerProcess(
        directory,
        "--api-key",
        KEY,
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--max-queue",
        "8",
        "--max-n",
        "4",
        "--max-prompts",
        "3",
        "--max-stop",
        "2",
        "--max-stop-length",
        "8",
        "--max-stop-token-ids",
        "2",
        "--max-logit-bias",
        "2",
        "--max-tools",
        "1",
        "--chat-template",
        str(directory / "template.jinja"),
        "--log-interval",
        "0",
    ).start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, **extra}


def completion_body(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **extra}


def assert_400(r: httpx.Response, param: str, words: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    for leak in ("Traceback", "Error:", "/work/", "site-packages", ".py"):
        assert leak not in error["message"], error


def assert_served(server) -> None:
    r = post(server, "/v1/completions", completion_body())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        (
            "/v1/chat/completions",
            chat_body(chat_template_kwargs={"chat_template": "{% for i in range(10**9) %}{% endfor %}"}),
            "chat_template_kwargs.chat_template",
            "not allowed",
        ),
        (
            "/v1/chat/completions",
            chat_body(chat_template_kwargs={"tokenize": True}),
            "chat_template_kwargs.tokenize",
            "not allowed",
        ),
        ("/v1/completions", completion_body(n=100000), "n", "<= 4"),
        ("/v1/completions", completion_body(prompt=["a", "b", "c", "d"]), "prompt", "at most 3"),
        ("/v1/completions", completion_body(prompt=["a", "b", "c"], n=3), "n", "sequences"),  # 9 > --max-queue 8
        ("/v1/completions", completion_body(stop=["a", "b", "c"]), "stop", "at most 2"),
        ("/v1/completions", completion_body(stop=["a" * 9]), "stop", "8 characters"),
        ("/v1/completions", completion_body(stop_token_ids=[1, 2, 3]), "stop_token_ids", "at most 2"),
        ("/v1/completions", completion_body(stop_token_ids=[10**7]), "stop_token_ids", "vocabulary"),
        ("/v1/completions", completion_body(logit_bias={"1": 1, "2": 1, "3": 1}), "logit_bias", "at most 2"),
        ("/v1/completions", completion_body(logit_bias={"99999999": 1}), "logit_bias", "vocabulary"),
        (
            "/v1/chat/completions",
            chat_body(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]),
            "tools",
            "at most 1",
        ),
        ("/v1/completions", completion_body(guided_json='{"a":' * 5000 + "1" + "}" * 5000), "guided_json", "nested"),
        (
            "/v1/completions",
            completion_body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": json.loads('{"properties":' * 70 + "{}" + "}" * 70)},
                }
            ),
            "response_format.json_schema.schema",
            "nested",
        ),
        ("/v1/chat/completions", dict(chat_body(min_tokens=300), max_tokens=None), "min_tokens", "left in the context"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, words):
    assert_400(post(server, path, body), param, words)


def test_template_errors_are_clean(server):
    r = post(server, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "forbidden"}]))
    assert_400(r, "messages", "this template refuses forbidden words")  # the template's own message
    r = post(
        server,
        "/v1/chat/completions",
        chat_body(messages=[{"role": "system", "content": "crash"}, {"role": "user", "content": "hi"}]),
    )
    assert_400(r, "messages", "the template failed on these messages")
    assert "undefined" not in r.json()["error"]["message"].lower()
    assert_served(server)


def test_operator_template_is_used(server):
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}, headers=AUTH).json()["prompt"]
    assert text == "user\nHi\nassistant\n"  # (special tokens skipped) no default system turn: the operator's


def test_tokenize_and_detokenize_need_the_key(server):
    assert post(server, "/tokenize", {"prompt": "Hi"}, headers=None).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1, 2]}, headers=None).status_code == 401
    assert post(server, "/tokenize", {"prompt": "Hi"}).status_code == 200


def test_models_do_not_show_file_paths(server):
    data = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert "/" not in json.dumps(data)


def test_logit_bias_steers_the_output(server):
    paris = post(server, "/tokenize", {"prompt": " Paris"}).json()["tokens"]
    assert len(paris) == 1
    r = post(
        server,
        "/v1/completions",
        completion_body(prompt="My favourite word is", max_tokens=3, logit_bias={str(paris[0]): 100}),
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris" * 3


def test_null_fields_are_accepted(server):
    r = post(
        server,
        "/v1/completions",
        completion_body(n=None, stream=None, logprobs=None, echo=None, stop=None, best_of=None, stream_options=None),
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
