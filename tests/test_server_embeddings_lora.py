"""/v1/embeddings and LoRA adapters on a real server, through the official `openai` client: a tiny
random Llama with the default model's tokenizer, one adapter loaded at start and one at run time,
checked against transformers / PEFT on the same weights."""

from __future__ import annotations

import httpx
import openai
import peft
import pytest
import torch
from helpers import greedy_reference, make_lora_adapter, make_tiny_model
from test_server_utils import metric_values, model_available, running_server

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

TEXTS = ["The quick brown fox", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("tiny-lora")
    base = make_tiny_model("llama-gqa-untied", root / "base", vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(root / "base")
    for name, seed, rank in (("a", 1, 8), ("b", 2, 4)):
        make_lora_adapter(base, root / name, seed, r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    args = ("--model", str(root / "base"), "--served-model-name", "tiny", "--log-interval", "0")
    lora = ("--lora-modules", f"a={root / 'a'}", "--max-loras", "2", "--max-lora-rank", "8")
    for srv in running_server(tmp_path_factory, "embed-lora", *args, "--num-kv-blocks", "64", *lora):
        yield srv, root, base


def hidden_last(model, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state of the last token, normalized."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return out / out.norm()


def test_embeddings_match_transformers(setup, tokenizer):
    srv, root, base = setup
    client = srv.openai_client()
    r = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and [d.index for d in r.data] == [0, 1]
    for d, p in zip(r.data, ids):
        torch.testing.assert_close(torch.tensor(d.embedding), hidden_last(base, p), rtol=0, atol=1e-4)
    one = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(r.data[1].embedding, abs=1e-6)
    adapted = peft.PeftModel.from_pretrained(base, root / "a").eval()
    try:
        via_a = client.embeddings.create(model="a", input=[ids[0]], encoding_format="float")
        torch.testing.assert_close(
            torch.tensor(via_a.data[0].embedding), hidden_last(adapted, ids[0]), rtol=0, atol=1e-4
        )
    finally:
        adapted.unload()
    for kwargs, param in (
        (dict(input=TEXTS, dimensions=16), "dimensions"),
        (dict(input=[]), "input"),
        (dict(input=[[1, 2], []]), "input"),
        (dict(input=[len(tokenizer.hf) + 5]), "input"),
        (dict(input="x", encoding_format="int8"), "encoding_format"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", **kwargs)
        assert e.value.body["param"] == param, kwargs


def test_lora_adapters_match_peft_and_load_at_run_time(setup, tokenizer):
    srv, root, base = setup
    client = srv.openai_client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"} and models["a"].parent == "tiny"
    prompt = tokenizer.encode(TEXTS[0])
    load = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")})
    assert load.status_code == 200, load.text
    for name in ("a", "b"):
        adapted = peft.PeftModel.from_pretrained(base, root / name).eval()
        ref = greedy_reference(adapted, prompt, 6)[0]
        adapted.unload()
        r = client.completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.model == name and r.choices[0].text == tokenizer.decode(ref)
    base_text = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert base_text.choices[0].text == tokenizer.decode(greedy_reference(base, prompt, 6)[0])
    assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=prompt, max_tokens=2)
    for route, body, status, param in (
        ("unload", {"lora_name": "b"}, 404, "lora_name"),
        ("load", {"lora_name": "a", "lora_path": str(root / "b")}, 400, "lora_name"),
        ("load", {"lora_name": "c", "lora_path": str(root / "missing")}, 400, "lora_path"),
        ("load", {"lora_path": str(root / "b")}, 400, "lora_name"),
    ):
        r = httpx.post(f"{srv.url}/v1/{route}_lora_adapter", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert {m.id for m in client.models.list().data} == {"tiny", "a"}
    values = metric_values(srv.url)
    assert values["tokenmill:num_free_kv_blocks"] == values["tokenmill:num_kv_blocks"]
