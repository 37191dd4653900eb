"""Automatic prefix caching, cache salts, hash collisions and priority scheduling."""

from __future__ import annotations

import random

import pytest
from helpers import make_core, make_tiny_model, run_core

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefix-model")
    make_tiny_model("llama-gqa-untied", directory)
    return str(directory), load_model(str(directory))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def one(core, rid: str, prompt: list[int], params=GREEDY, **kwargs):
    """Run one request to the end; returns (generated ids, cached prompt tokens)."""
    core.add_request(EngineCoreRequest(rid, prompt, params, **kwargs))
    ids, cached = [], None
    while core.has_unfinished():
        for o in core.step():
            ids += o.new_token_ids
            cached = o.num_cached_tokens
    return ids, cached


def pool_whole(core) -> bool:
    return core.kv.num_free_blocks == core.kv.num_blocks and not any(m.req_blocks for m in core.kv.managers)


@pytest.mark.parametrize("length", [15, 16, 17, 100, 160])
def test_repeat_prompt_hits_whole_blocks_and_matches_uncached(tiny, length):
    directory, loaded = tiny
    prompt = tokens(length, seed=length)
    reference, _ = one(make_core(directory, loaded=loaded, prefix_caching=False), "r", prompt)
    core = make_core(directory, loaded=loaded)
    first, cached_first = one(core, "a", prompt)
    second, cached_second = one(core, "b", prompt)
    assert cached_first == 0
    assert cached_second == (length - 1) // 16 * 16  # whole blocks, last token always recomputed
    assert first == second == reference
    assert core.kv.prefix_queries == 2 * length and core.kv.prefix_hits == cached_second
    assert pool_whole(core)


def test_partial_prefix_hits_exactly_the_shared_blocks(tiny):
    directory, loaded = tiny
    shared = tokens(50, seed=1)  # 3 full blocks + 2 tokens
    a, b = shared + tokens(30, seed=2), shared + tokens(30, seed=3)
    core = make_core(directory, loaded=loaded)
    one(core, "a", a)
    out_b, cached = one(core, "b", b)
    assert cached == 48
    reference, _ = one(make_core(directory, loaded=loaded, prefix_caching=False), "r", b)
    assert out_b == reference


def test_generated_tokens_are_cached_too(tiny):
    """A follow-up that re-sends prompt + answer (multi-turn) hits the answer's blocks as well."""
    directory, loaded = tiny
    prompt = tokens(40, seed=4)
    core = make_core(directory, loaded=loaded)
    answer, _ = one(core, "a", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    follow_up = prompt + answer + tokens(5, seed=5)
    _, cached = one(core, "b", follow_up)
    assert cached == (40 + 30 - 1) // 16 * 16  # everything the first request computed in full blocks


def test_eviction_under_a_tiny_pool_keeps_outputs_correct(tiny):
    directory, loaded = tiny
    prompts = [tokens(60, seed=10 + i // 6) + tokens(10, seed=100 + i) for i in range(24)]
    reference = run_core(make_core(directory, loaded=loaded, prefix_caching=False), prompts, GREEDY)
    core = make_core(directory, num_blocks=14, loaded=loaded)  # fits ~2 requests: constant eviction
    out = run_core(core, prompts, GREEDY)
    assert out == reference
    assert core.kv.prefix_hits > 0 and pool_whole(core)


def test_cache_salt_isolates_tenants(tiny):
    directory, loaded = tiny
    prompt = tokens(64, seed=6)
    core = make_core(directory, loaded=loaded)
    out_a, _ = one(core, "a", prompt, cache_salt="tenant-a")
    out_b, cached_b = one(core, "b", prompt, cache_salt="tenant-b")
    out_none, cached_none = one(core, "c", prompt)
    out_a2, cached_a2 = one(core, "d", prompt, cache_salt="tenant-a")
    assert cached_b == 0 and cached_none == 0 and cached_a2 == 48
    assert out_a == out_b == out_none == out_a2


def test_hash_collisions_never_serve_wrong_kv(tiny):
    directory, loaded = tiny
    core = make_core(directory, loaded=loaded)
    core.kv.managers[0].hash_fn = lambda parent, tokens: 42  # every block of every prompt collides
    prompts = [tokens(80, seed=20 + i) for i in range(4)]
    reference = run_core(make_core(directory, loaded=loaded, prefix_caching=False), prompts, GREEDY)
    outs = {str(i): one(core, str(i), p)[0] for i, p in enumerate(prompts)}
    assert outs == reference
    assert core.kv.prefix_hits == 0  # the token comparison rejected every colliding block
    again, cached = one(core, "again", prompts[0])
    assert again == reference["0"]


def test_a_hit_matches_the_whole_chain_not_just_the_tokens(tiny):
    """A prompt whose second block repeats its first: under colliding keys the second block finds the
    cached first block, with the same tokens but another parent (and position). Reusing it would be
    wrong KV; the parent check refuses it."""
    directory, loaded = tiny
    block = tokens(16, seed=40)
    prompt = block + block + tokens(9, seed=41)
    reference = run_core(make_core(directory, loaded=loaded, prefix_caching=False), [prompt], GREEDY)["0"]
    core = make_core(directory, loaded=loaded)
    core.kv.managers[0].hash_fn = lambda parent, tokens: 42
    first, _ = one(core, "a", prompt)
    second, cached = one(core, "b", prompt)
    assert first == second == reference
    assert cached == 16  # the first block only


@pytest.mark.parametrize("name", ["blake2b", "sha256", "builtin"])
def test_hash_options(tiny, name):
    from tokenmill.engine.kv_cache_manager import HASH_FUNCTIONS

    directory, loaded = tiny
    core = make_core(directory, loaded=loaded)
    core.kv.managers[0].hash_fn = HASH_FUNCTIONS[name]
    prompt = tokens(40, seed=7)
    first, _ = one(core, "a", prompt)
    second, cached = one(core, "b", prompt)
    assert cached == 32 and first == second


def test_reset_prefix_cache(tiny):
    directory, loaded = tiny
    core = make_core(directory, loaded=loaded)
    prompt = tokens(40, seed=8)
    one(core, "a", prompt)
    assert core.reset_prefix_cache() > 0
    _, cached = one(core, "b", prompt)
    assert cached == 0 and pool_whole(core)


def test_priority_policy_orders_admission_and_preemption(tiny):
    directory, loaded = tiny
    core = make_core(directory, loaded=loaded, policy="priority", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    order = []
    for i, prio in enumerate([5, 3, 9, 0, 3, 1]):
        core.add_request(EngineCoreRequest(f"p{prio}-{i}", tokens(20, seed=i), params, priority=prio))
    while core.has_unfinished():
        for o in core.step():
            if o.finish_reason:
                order.append(o.request_id)
    assert order == ["p0-3", "p1-5", "p3-1", "p3-4", "p5-0", "p9-2"]  # priority, then arrival

    # under KV pressure the lowest-priority running request is the one preempted
    core = make_core(directory, loaded=loaded, policy="priority", num_blocks=10)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    core.add_request(EngineCoreRequest("low", tokens(40, seed=30), long, priority=9))
    core.add_request(EngineCoreRequest("high", tokens(40, seed=31), long, priority=0))
    preempted = []
    while core.has_unfinished():
        core.step()
        preempted += core.last_schedule.preempted_request_ids
    assert preempted and set(preempted) == {"low"}
    assert pool_whole(core)


def run_together(core, prompts: list[list[int]], params=GREEDY) -> tuple[list[list[int]], int, list[int]]:
    """Submit every prompt at once and run to the end: (outputs, prompt tokens scheduled, cached tokens)."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"s{i}", prompt, params))
    outs, cached, scheduled = {i: [] for i in range(len(prompts))}, {}, 0
    while core.has_unfinished():
        for o in core.step():
            i = int(o.request_id[1:])
            outs[i] += o.new_token_ids
            cached[i] = o.num_cached_tokens
        scheduled += sum(core.last_schedule.num_scheduled_tokens.values())
    return [outs[i] for i in range(len(prompts))], scheduled, [cached[i] for i in range(len(prompts))]


@pytest.mark.parametrize("budget", [64, 512])
def test_requests_arriving_together_compute_their_shared_prefix_once(tiny, budget):
    """Sessions that start at once with one long system prompt: the later ones wait for the blocks the first
    is filling (over several chunks when the budget is small) and take them from the cache, instead of each
    prefilling the prefix; outputs stay those of each request alone."""
    directory, loaded = tiny
    shared = tokens(200, seed=40)  # 12 full blocks + 8 tokens
    prompts = [shared + tokens(10, seed=41 + i) for i in range(4)]
    core = make_core(directory, loaded=loaded, max_num_batched_tokens=budget)
    outs, scheduled, cached = run_together(core, prompts)
    generated = 4 * (GREEDY.max_tokens - 1)  # decode steps: one token each, the first comes from the prefill
    assert scheduled - generated == 210 + 3 * (210 - 192)  # the prefix once, then each one's last 18 tokens
    assert cached == [0, 192, 192, 192]
    alone = [one(make_core(directory, loaded=loaded, prefix_caching=False), "r", p)[0] for p in prompts]
    assert outs == alone
    assert pool_whole(core) and not any(m.computing for m in core.kv.managers)


def test_a_request_waiting_on_a_prefix_is_not_stuck_when_its_filler_is_aborted(tiny):
    directory, loaded = tiny
    shared = tokens(200, seed=50)
    core = make_core(directory, loaded=loaded, max_num_batched_tokens=64)
    core.add_request(EngineCoreRequest("filler", shared + [1], GREEDY))
    core.add_request(EngineCoreRequest("waiter", shared + [2], GREEDY))
    core.step()  # the filler's first chunk: the rest of its prompt blocks are marked as being filled
    assert core.kv.managers[0].computing
    core.abort_requests(["filler"])
    assert not core.kv.managers[0].computing  # else the waiter would wait for blocks nobody fills
    out = []
    for _ in range(100):
        if not core.has_unfinished():
            break
        for o in core.step():
            out += o.new_token_ids
    assert out == one(make_core(directory, loaded=loaded, prefix_caching=False), "r", shared + [2])[0]
    assert pool_whole(core) and not any(m.computing for m in core.kv.managers)
