"""Scoring through the server as evaluation harnesses do it: echo + logprobs with max_tokens 0,
vLLM's prompt_logprobs, streamed and not, checked against transformers on the same GGUF weights
(float32); and the OpenAPI schema."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest
import torch
from helpers import EVAL_ITEMS, check_eval_result, reference_loglikelihood
from test_server_utils import MODEL, model_available, running_server, sse_events

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not installed")

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a small budget: prompts are scored chunk by chunk; --dtype float32: the exact mode, as transformers
    yield from running_server(
        tmp_path_factory,
        "scoring",
        "--num-kv-blocks",
        "64",
        "--max-num-batched-tokens",
        "8",
        "--log-interval",
        "0",
        "--dtype",
        "float32",
    )


@pytest.fixture(scope="module")
def reference(hf_default_model, tokenizer):
    """transformers' log-probabilities of each prompt token given the ones before it."""
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        lp = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0], dim=-1)
    return ids, [lp[j - 1, ids[j]].item() for j in range(1, len(ids))], lp


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def test_echo_with_max_tokens_zero_scores_the_prompt(server, reference):
    ids, want, _ = reference
    r = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI does
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < 1e-3
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])


def test_streamed_echo_gives_the_same_numbers(server, reference):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        events = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    plain = post(server, "/v1/completions", dict(body, stream=False)).json()["choices"][0]
    assert first["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"][: len(reference[0])]
    assert PROMPT + "".join(e["choices"][0]["text"] for e in events[1:] if e["choices"]) == plain["text"]


def test_vllm_prompt_logprobs_field(server, reference):
    ids, want, lp = reference
    r = post(server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 3, "max_tokens": 1, "temperature": 0})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for j in range(1, len(ids)):
        own = entries[j][str(ids[j])]
        assert (
            abs(own["logprob"] - want[j - 1]) < 1e-3 and own["rank"] == int((lp[j - 1] > lp[j - 1, ids[j]]).sum()) + 1
        )
        assert {int(t) for t, e in entries[j].items() if e["rank"] <= 3} >= set(lp[j - 1].topk(3).indices.tolist()) - {
            ids[j]
        }
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_official_client_scores_like_lm_eval(server, reference):
    ids, want, _ = reference
    client = server.openai_client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert r.choices[0].logprobs.token_logprobs[0] is None
    assert abs(sum(r.choices[0].logprobs.token_logprobs[1:]) - sum(want)) < 1e-2


def test_scoring_errors_name_the_field(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(server, "/v1/completions", {"prompt": "x", "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "prompt_logprobs": 1},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_openapi_describes_every_endpoint_and_field(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    } <= set(schema["paths"])
    components = schema["components"]["schemas"]
    completion = components["CompletionRequest"]["properties"]
    assert {
        "prompt",
        "echo",
        "logprobs",
        "prompt_logprobs",
        "max_tokens",
        "logit_bias",
        "structured_outputs",
        "cache_salt",
        "priority",
    } <= set(completion)
    assert {"messages", "tools", "tool_choice", "chat_template_kwargs"} <= set(
        components["ChatCompletionRequest"]["properties"]
    )
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    assert "swagger" in httpx.get(f"{server.url}/docs").text.lower()


def test_tokenmill_eval_perplexity_of_the_shipped_corpus(server, hf_default_model, tokenizer, tmp_path):
    """`tokenmill eval perplexity` (the corpus tokenmill ships, first chunks) against transformers."""
    from tokenmill.eval.tasks import corpus_items

    out = tmp_path / "ppl.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.entrypoints.cli",
            "eval",
            "perplexity",
            "--limit",
            "2",
            "--chunk-chars",
            "600",
            "--base-url",
            f"{server.url}/v1",
            "--output",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    total = tokens = 0
    for item in corpus_items(chunk_chars=600)[:2]:
        ids = tokenizer.encode(item["text"])
        with torch.no_grad():
            lp = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        total += sum(lp[j - 1, ids[j]].item() for j in range(1, len(ids)))
        tokens += len(ids) - 1
    assert result["kind"] == "perplexity" and result["items"] == 2
    assert abs(math.log(result["token_perplexity"]) - (-total / tokens)) < 1e-4


def run_eval_cli(server, items: list[dict], tmp_path) -> dict:
    task, out = tmp_path / "task.jsonl", tmp_path / "result.json"
    task.write_text("".join(json.dumps(item) + "\n" for item in items))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.entrypoints.cli",
            "eval",
            "--task",
            str(task),
            "--base-url",
            f"{server.url}/v1",
            "--output",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    return json.loads(out.read_text())


def test_tokenmill_eval_scores_multiple_choice_through_the_server(server, hf_default_model, tokenizer, tmp_path):
    result = run_eval_cli(server, EVAL_ITEMS, tmp_path)
    assert result["kind"] == "multiple_choice"
    check_eval_result(result, EVAL_ITEMS, hf_default_model, tokenizer)


def test_tokenmill_eval_scores_loglikelihood_through_the_server(server, hf_default_model, tokenizer, tmp_path):
    items = [{"context": i["context"], "continuation": c} for i in EVAL_ITEMS for c in i["choices"][:2]]
    result = run_eval_cli(server, items, tmp_path)
    assert result["kind"] == "loglikelihood" and result["items"] == len(items)
    for item, got in zip(items, result["per_item"]):
        ll, greedy = reference_loglikelihood(hf_default_model, tokenizer, item["context"], item["continuation"])
        assert abs(got["loglikelihood"] - ll) < 1e-3 and got["is_greedy"] == greedy
    assert result["greedy_fraction"] == sum(p["is_greedy"] for p in result["per_item"]) / len(items)
