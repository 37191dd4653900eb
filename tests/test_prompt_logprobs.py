"""Prompt logprobs from the engine against transformers (float32, same weights): token by token,
whole prompts and chunked prefill, with the prefix cache on (a request that asks recomputes its
prompt) and off; and scoring with max_tokens 0."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_core, make_tiny_model

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

TOP = 3


@pytest.fixture(scope="module", params=["llama-gqa-untied", "qwen2-bias"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, directory)
    return str(directory), load_model(str(directory)), hf


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]


def collect(core, prompts: list[list[int]], params: SamplingParams) -> dict[str, tuple[list, list[int], int]]:
    """request id -> (prompt logprobs, generated ids, cached prompt tokens)."""
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, params))
        out[str(i)] = [None, [], 0]
    while core.has_unfinished():
        for o in core.step():
            if o.prompt_logprobs is not None:
                out[o.request_id][0] = o.prompt_logprobs
            out[o.request_id][1] += o.new_token_ids
            out[o.request_id][2] = o.num_cached_tokens
    return {k: tuple(v) for k, v in out.items()}


def check(entries: list, ids: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    scale = max(1.0, ref.abs().max().item())
    for j in range(1, len(ids)):
        entry, want = entries[j], ref[j - 1]
        assert abs(entry[ids[j]].logprob - want[ids[j]].item()) <= 1e-4 * scale, f"position {j}"
        assert entry[ids[j]].rank == int((want > want[ids[j]]).sum()) + 1
        top = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= TOP)  # the top-N, by rank
        assert torch.allclose(torch.tensor([v for _, v in top]), want.topk(TOP).values, atol=1e-4 * scale)


@pytest.mark.parametrize("budget", [512, 16], ids=["whole-prompts", "chunked"])
def test_prompt_logprobs_match_transformers(tiny, budget):
    directory, loaded, hf = tiny
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 2, 9, 33, 70)]
    core = make_core(directory, loaded=loaded, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    first = collect(core, prompts, params)
    again = collect(core, prompts, params)  # the prefix cache holds these prompts now
    for i, ids in enumerate(prompts):
        ref = reference(hf, ids)
        for entries, generated, cached in (first[str(i)], again[str(i)]):
            check(entries, ids, ref)
            assert cached == 0 and len(generated) == 3  # asked for prompt logprobs: recomputed, not cached
    plain = collect(core, [prompts[-1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))["0"]
    assert plain[0] is None and plain[2] == 64 and plain[1] == first["4"][1]  # others still hit the cache
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_max_tokens_zero_scores_the_prompt_only(tiny):
    directory, loaded, hf = tiny
    ids = list(range(40, 90))
    core = make_core(directory, loaded=loaded, max_num_batched_tokens=16)
    got = collect(core, [ids], SamplingParams(max_tokens=0, prompt_logprobs=0))["0"]
    assert got[1] == []
    ref = reference(hf, ids)
    assert got[0][0] is None and all(len(e) == 1 for e in got[0][1:])  # N = 0: only the prompt token's own entry
    for j, entry in enumerate(got[0][1:], start=1):
        assert abs(entry[ids[j]].logprob - ref[j - 1, ids[j]].item()) <= 1e-4 * max(1.0, ref.abs().max().item())
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.requests
    with pytest.raises(ValueError, match="max_tokens can be 0 only"):
        SamplingParams(max_tokens=0)
