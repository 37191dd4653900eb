"""Embeddings in the engine against transformers' final hidden states on the same tiny random weights:
last-token pooling of an embedding checkpoint saved from the bare decoder (Qwen3-Embedding's layout),
mean pooling over a chunked prompt next to a generating request, prefix-cache hits only where
harmless, and the server's convention / Matryoshka helpers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import TINY_BASE, TINY_MODELS, assert_greedy_of, make_core, make_tiny_model

from tokenmill.engine.core import RequestRejected
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.serving_embeddings import (
    EmbeddingConvention,
    _check_dimensions,
    _normalize,
    embedding_convention,
)

PROMPTS = [[5, 9, 200, 31, 7, 88, 14, 3, 3, 40, 41, 42, 100, 2, 9, 9, 17, 18, 19, 20], [77, 1, 60], [8]]


def embed(core, prompts: list[list[int]], pooling: str, extra: dict | None = None) -> dict[str, object]:
    """Each prompt's pooled vector (and the outputs of `extra`: id -> (prompt, params)) through the core."""
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"e{i}", p, SamplingParams(max_tokens=0, pooling=pooling)))
    for rid, (p, params) in (extra or {}).items():
        core.add_request(EngineCoreRequest(rid, p, params))
    out: dict[str, object] = {rid: [] for rid in extra or {}}
    while core.has_unfinished():
        for o in core.step():
            if o.request_id.startswith("e"):
                assert o.finish_reason == "length" and o.new_token_ids == []
                out[o.request_id] = (torch.tensor(o.pooled), o.num_cached_tokens)
            else:
                out[o.request_id] += o.new_token_ids
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return out


def test_headless_embedding_checkpoint_last_token(tmp_path):
    cls, extra = TINY_MODELS["qwen3"]
    torch.manual_seed(0)
    hf = transformers.Qwen3Model(cls(**{**TINY_BASE, **extra})).eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    core = make_core(str(tmp_path), block_size=4, num_blocks=64)
    got = embed(core, PROMPTS, "last")
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0, -1]
        torch.testing.assert_close(got[f"e{i}"][0], ref, rtol=0, atol=1e-4)
    with pytest.raises(RequestRejected) as e:  # no LM head: it generates nothing
        core.add_request(EngineCoreRequest("g", PROMPTS[1], SamplingParams(max_tokens=2)))
    assert e.value.param == "model"


def test_mean_pooling_chunked_beside_generation_and_prefix_hits(tmp_path):
    hf = make_tiny_model("llama-gqa-untied", tmp_path)
    core = make_core(str(tmp_path), block_size=4, num_blocks=64, max_num_batched_tokens=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = embed(core, PROMPTS, "mean", {"g": (PROMPTS[0], greedy)})
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.model(torch.tensor([p])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(got[f"e{i}"][0], ref, rtol=0, atol=1e-4)
    assert_greedy_of(hf, PROMPTS[0], got["g"], 6)
    # the prompt's blocks are cached now: mean pooling needs every position, so it takes no hits;
    # last-token pooling takes them (its last token is always computed)
    again = embed(core, PROMPTS[:1], "mean")["e0"]
    assert again[1] == 0 and torch.equal(again[0], got["e0"][0])
    last = embed(core, PROMPTS[:1], "last")["e0"]
    assert last[1] > 0
    with torch.no_grad():
        ref = hf.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
    torch.testing.assert_close(last[0], ref, rtol=0, atol=1e-4)


def test_convention_and_matryoshka(tmp_path):
    assert embedding_convention(str(tmp_path / "model.gguf")) == EmbeddingConvention()
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    convention = embedding_convention(str(tmp_path))
    assert convention == EmbeddingConvention("mean", True, (32, 64))
    _check_dimensions(32, convention, 64)
    for dims, plain in ((16, False), (32, True)):
        with pytest.raises(Exception, match="dimensions") as e:
            _check_dimensions(dims, convention if not plain else EmbeddingConvention(), 64)
        assert e.value.param == "dimensions"
    vector = [3.0, 4.0, 12.0]
    assert _normalize(vector, 2) == [0.6, 0.8]
    assert _normalize(vector, None) == pytest.approx([3 / 13, 4 / 13, 12 / 13])


def test_mean_pooling_gives_the_same_bits_however_the_steps_cut_the_prompt():
    """The same prompt embedded alone or beside other requests is cut into other chunks (the step budget,
    --long-prefill-share): its mean must not change by a bit."""
    from tokenmill.worker.request_state import MeanPool

    rows = torch.randn(53, 24) * torch.logspace(-3, 3, 24)  # magnitudes that make sum orders differ

    def pooled(cuts: list[int]) -> torch.Tensor:
        pool, start = MeanPool(), 0
        for end in [*cuts, len(rows)]:
            pool.add(rows[start:end], restart=start == 0)
            start = end
        return pool.mean(len(rows))

    whole = pooled([])
    for cuts in ([5, 16, 17, 30], list(range(1, 53)), [32], [8, 40, 52]):
        assert torch.equal(pooled(cuts), whole), cuts
    torch.testing.assert_close(whole, rows.double().mean(0).float(), rtol=1e-5, atol=1e-5)
