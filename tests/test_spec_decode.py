"""Speculative decoding (n-gram proposer): greedy output identical to decoding without it, sampling
with the target's distribution (chi-square), rollback that leaves the KV pool whole, opt-outs."""

from __future__ import annotations

import math
import random

import httpx
import pytest
import torch
from helpers import make_core, make_tiny_model, run_core
from test_server_utils import MODEL, model_available, running_server

from tokenmill.config import SpeculativeConfig
from tokenmill.sample.rejection_sampler import target_probs, verify
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.ngram import NgramDrafter

# every eligible request drafts (no sizing by acceptance): the tests check what verification does
SPEC = SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=64, min_acceptance=0.0)


def test_ngram_proposer_drafts_what_followed_the_last_n_tokens():
    p = NgramDrafter(2, 3)
    assert p.lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" seen before, followed by 4 5 9
    assert p.lookup([7, 1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # the 3-gram "1 2 3" wins over shorter ones
    assert p.lookup([1, 2, 3, 4], 3) == []  # no n-gram recurs
    assert p.lookup([5, 5, 5, 5], 3) == [5]  # the latest match with 3 tokens after it is missing: the earliest
    assert p.lookup([1, 2, 1, 2], 0) == []


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile for p ~ 0.0005 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times (the rest pooled)."""
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    nonzero = exp > 0
    return float(((obs[nonzero] - exp[nonzero]) ** 2 / exp[nonzero]).sum()), int(nonzero.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=12),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "top-k", "top-p"],
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    """The first emitted token is distributed as p_1 whatever the draft; after an accepted first draft
    the second is distributed as p_2."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 2
    probs = target_probs(logits, params)
    drafts = [int(probs[0].argmax()), int(probs[1].argsort()[-2])]  # a likely first draft, a so-so second
    n = 20000
    first, second = torch.zeros(40), torch.zeros(40)
    for _ in range(n):
        out = verify(logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    stat, df = chi_square(first, probs[0], n)
    assert stat < chi_square_critical(df)
    stat, df = chi_square(second, probs[1], int(first[drafts[0]]))
    assert stat < chi_square_critical(df)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)], ids=["t1", "top-p"]
)
def test_rejection_sampling_with_sampled_drafts_keeps_the_target_distribution(params):
    """Drafts drawn from a draft distribution q (min(1, p/q) acceptance, residual max(p - q, 0)): the first
    emitted token is distributed as p_1, the second (after an accepted first draft) as p_2."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=gen) * 2
    probs = target_probs(logits, params)
    q = torch.softmax(logits[:2] + torch.randn(2, 30, generator=gen) * 1.5, dim=-1)  # a related, different q
    n = 20000
    first, second, accepted_first = torch.zeros(30), torch.zeros(30), 0
    for _ in range(n):
        drafts = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        out = verify(logits, drafts, params, gen, draft_probs=q)
        first[out[0]] += 1
        if len(out) > 1:  # the first draft was accepted: out[1] is the second position's token
            accepted_first += 1
            second[out[1]] += 1
    stat, df = chi_square(first, probs[0], n)
    assert stat < chi_square_critical(df)
    stat, df = chi_square(second, probs[1], accepted_first)
    assert stat < chi_square_critical(df)
    assert 0.2 * n < accepted_first < n  # q is neither p nor disjoint from it: some drafts rejected


def test_greedy_verification_accepts_the_argmax_run():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [3, 4, 5], greedy, None) == [3, 4, 5, 6]  # all accepted + the bonus token
    assert verify(logits, [3, 9, 5], greedy, None) == [3, 4]  # stops at the first mismatch


def repetitive_prompts(n: int, length: int = 48) -> list[list[int]]:
    rng = random.Random(2)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(256) for _ in range(rng.randrange(3, 9))]
        prompts.append((motif * (length // len(motif) + 1))[:length])
    return prompts


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias", "mistral-window", "gemma2"])
def test_greedy_output_is_identical_with_speculation(tmp_path, name):
    """Decodes verified in batches with others, sliding windows and soft-caps included; requests with
    logprobs, penalties, logit bias and min_tokens speculate too (each verified row processed with the
    drafts before it in the output), one that opted out runs beside them unchanged."""
    make_tiny_model(name, tmp_path)
    prompts = repetitive_prompts(8)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [
        greedy,
        greedy,
        greedy,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.2,
            logit_bias={int(prompts[6][0]): 2.0},
        ),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[int(prompts[7][1])]),
    ]
    plain_logprobs, spec_logprobs = {}, {}
    plain = run_core(make_core(str(tmp_path), block_size=8), prompts, params, logprobs=plain_logprobs)
    core = make_core(str(tmp_path), block_size=8, speculative=SPEC)
    drafted = set()
    spec = run_core(
        core, prompts, params, on_step=lambda c: drafted.update(c.last_schedule.spec_token_ids), logprobs=spec_logprobs
    )
    assert spec == plain
    assert len(spec_logprobs["3"]) == len(plain_logprobs["3"]) == 40
    for got, want in zip(spec_logprobs["3"], plain_logprobs["3"]):  # the same logprobs, token by token
        assert got.keys() == want.keys()
        assert all(
            got[t].rank == want[t].rank and got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4) for t in got
        )
    stats = core.scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    # all may draft but the one that opted out (a penalty that stops repetition leaves n-grams nothing)
    assert "3" in drafted and drafted & {"5", "6", "7"} and "4" not in drafted
    assert core.kv.num_free_blocks == core.kv.num_blocks  # rollback and finishing returned every block


def test_the_runner_drafts_ngrams_on_the_tokens_its_step_produced(tmp_path):
    """n-gram drafting runs in the model runner at the end of the step: every draft the core keeps is a
    prefix of the lookup on the request's tokens after the step (its newest sampled or accepted ones
    included), at most the tokens it may still generate."""
    make_tiny_model("llama-gqa-untied", tmp_path)
    core = make_core(str(tmp_path), block_size=8, speculative=SPEC)
    assert isinstance(core.executor.runner.drafter, NgramDrafter)
    lookup = NgramDrafter(SPEC.prompt_lookup_min, SPEC.prompt_lookup_max).lookup
    checked = []

    def check(c):
        for r in c.scheduler.running:
            if r.spec_token_ids:
                k = min(SPEC.num_speculative_tokens, r.max_tokens - len(r.output_token_ids) - 1)
                assert r.spec_token_ids == lookup(r.prompt_token_ids + r.output_token_ids, k)[: len(r.spec_token_ids)]
                checked.append(r.request_id)

    run_core(core, repetitive_prompts(4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), on_step=check)
    assert set(checked) == {"0", "1", "2", "3"}


def test_speculation_with_prefix_caching_preemption_and_a_small_pool(tmp_path):
    """Shared prefixes (blocks cached from verified tokens only), a pool so small that requests are
    preempted: the same greedy tokens, and every block back at the end."""
    make_tiny_model("llama-gqa-untied", tmp_path)
    base = repetitive_prompts(1, 40)[0]
    prompts = [base + [i, i + 1] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # 32 blocks hold one request alone (23) but not all five, even sharing the prefix's 10
    plain = run_core(make_core(str(tmp_path), block_size=4, num_blocks=32), prompts, greedy)
    core = make_core(str(tmp_path), block_size=4, num_blocks=32, speculative=SPEC)
    assert run_core(core, prompts, greedy) == plain
    assert core.scheduler.num_preemptions > 0 and core.scheduler.spec_stats.num_accepted_tokens > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
    again = run_core(core, prompts[:2], greedy)  # served from the prefix cache now
    assert again == {k: plain[k] for k in ("0", "1")}


def test_seeded_sampling_is_reproducible_and_stops_are_kept(tmp_path):
    make_tiny_model("llama-gqa-untied", tmp_path)
    prompts = repetitive_prompts(3)
    core = make_core(str(tmp_path), speculative=SPEC)
    seeded = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    a, b = run_core(core, prompts, seeded), run_core(core, prompts, seeded)
    assert a == b and all(len(v) == 30 for v in a.values())
    greedy = run_core(core, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))["0"]
    stop_at = greedy.index(greedy[12])  # a stop token inside a run of accepted drafts ends the output there
    stopped = run_core(core, prompts[:1], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy[12]]))
    assert stopped["0"] == greedy[: stop_at + 1]
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_under_load_nothing_is_drafted(tmp_path):
    make_tiny_model("llama-gqa-untied", tmp_path)
    core = make_core(str(tmp_path), speculative=SpeculativeConfig(disable_by_batch_size=2))
    loaded_steps = []

    def check(c):
        if len(c.scheduler.running) > 2:
            loaded_steps.append(c)
            assert not any(r.spec_token_ids for r in c.scheduler.running)

    run_core(core, repetitive_prompts(4), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), on_step=check)
    assert loaded_steps and core.scheduler.spec_stats.num_drafts == 0


def test_speculative_config_errors():
    with pytest.raises(ValueError, match="speculative_config.method must be one of ngram"):
        SpeculativeConfig(method="medusa2")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="unknown fields num_spec"):
        SpeculativeConfig.from_json('{"num_spec": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    if not model_available():
        pytest.skip(f"{MODEL} is not installed")
    yield from running_server(
        tmp_path_factory,
        "spec",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "256",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 6}',
    )


def test_server_speculates_with_the_same_greedy_text_and_reports_it(spec_server, exact_llm):
    """The default model through the real server with the official client: the same greedy text as
    without speculation (in-process, exact mode), the acceptance counters in /metrics, and a request
    that opts out drafts nothing."""
    code = open(__file__).read()[:1500]
    prompt = f"Here is a Python file:\n{code}\nThe same file again, unchanged:\n{code[:200]}"
    client = spec_server.openai_client()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0).choices[0].text
    metrics = httpx.get(f"{spec_server.url}/metrics").text
    accepted = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tokenmill:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and accepted[0] > 0
    assert "tokenmill:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    want = exact_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0].text
    assert got == want
    opted_out = (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"speculative": False}
        )
        .choices[0]
        .text
    )
    after = httpx.get(f"{spec_server.url}/metrics").text
    assert [line for line in after.splitlines() if line.startswith("tokenmill:spec_decode_num_drafts_total")] == [
        line for line in metrics.splitlines() if line.startswith("tokenmill:spec_decode_num_drafts_total")
    ]
    assert opted_out == want[: len(opted_out)]


def test_draft_length_follows_the_acceptance_rate():
    from tokenmill.spec_decode import draft_length

    assert draft_length(1.0, 0.4, 6) == 6
    assert draft_length(0.8, 0.4, 6) == 4  # 0.8 ** 4 = 0.41, 0.8 ** 5 = 0.33
    assert draft_length(0.3, 0.4, 6) == 0
    assert draft_length(0.9, 0.0, 3) == 3


def test_drafts_are_sized_by_acceptance(tmp_path):
    """Requests whose drafts are rejected draft less (the same tokens either way)."""
    make_tiny_model("llama-gqa-untied", tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(2)]  # little to look up
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    always, sized = (
        make_core(str(tmp_path), speculative=SPEC),
        make_core(str(tmp_path), speculative=SpeculativeConfig(num_speculative_tokens=5)),
    )
    assert run_core(always, prompts, greedy) == run_core(sized, prompts, greedy)
    a, s = always.scheduler.spec_stats, sized.scheduler.spec_stats
    assert a.num_draft_tokens > 0 and s.num_draft_tokens < a.num_draft_tokens
    if s.num_draft_tokens:
        assert s.num_accepted_tokens / s.num_draft_tokens >= a.num_accepted_tokens / a.num_draft_tokens


def test_n_greater_than_one_speculates_per_sample(exact_llm):
    """Each of an n > 1 request's samples is a request of its own, so each speculates: greedy samples
    equal the output without speculation; seeded sampled ones (seed + i per sample) are reproducible
    and differ from each other; the pool is whole afterwards."""
    if not model_available():
        pytest.skip(f"{MODEL} is not installed")
    from tokenmill import LLM

    code = open(__file__).read()[:1200]
    prompt = f"{code}\nThe same text again:\n{code[:120]}"
    spec = {"method": "ngram", "min_acceptance": 0.0}
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=256, speculative_config=spec)  # 256 blocks: room for n=3
    greedy = SamplingParams(temperature=0, max_tokens=48, n=2)
    got = [o.token_ids for o in llm.generate([prompt], greedy, use_tqdm=False)[0].outputs]
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    want = exact_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    want = want.token_ids
    assert got == [want, want]
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=32, n=3)
    first, again = ([o.token_ids for o in llm.generate([prompt], sampled, use_tqdm=False)[0].outputs] for _ in range(2))
    assert first == again and len({tuple(t) for t in first}) > 1
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_blocks
