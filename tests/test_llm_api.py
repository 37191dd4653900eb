"""The offline Python API on the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
from helpers import EVAL_ITEMS, check_eval_result

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.request_queue import PriorityQueue
from tokenmill.engine_args import EngineArgs, add_engine_args
from tokenmill.fields import from_attributes, same_named


@pytest.fixture(scope="module")
def llm(exact_llm):
    return exact_llm  # exact: compared with transformers


def pool_whole(llm) -> bool:
    core = llm.engine.core
    return core.kv.num_free_blocks == core.kv.num_blocks and not llm.engine.processor.requests


def test_generate_returns_vllm_style_outputs(llm):
    prompts = ["The capital of France is", "def add(a, b):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for out, prompt in zip(outs, prompts):
        assert out.prompt_token_ids == tok.encode(prompt)
        sample = out.outputs[0]
        assert out.finished and sample.finish_reason in ("stop", "length")
        assert sample.text == tok.decode(sample.token_ids)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == len(sample.token_ids)
    assert "Paris" in outs[0].outputs[0].text
    assert pool_whole(llm)


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=30),
        use_tqdm=False,
    )[0]
    assert "<|im_start|>assistant" in llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_stop_string_across_tokens_is_trimmed(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert " 7," in text
    cut = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=24, stop=[" 7,"]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.text == text[: text.index(" 7,")] and cut.finish_reason == "stop" and cut.stop_reason == " 7,"
    kept = llm.generate(
        "1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=24, stop=[" 7,"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == text[: text.index(" 7,") + 3]
    assert pool_whole(llm)


def test_n_samples_logprobs_and_per_prompt_params(llm):
    outs = llm.generate(
        ["Once upon a time", "The best way to learn is"],
        [
            SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert len(outs[0].outputs) == 3 and [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    sample = outs[1].outputs[0]
    assert len(sample.logprobs) == 5
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert math.isclose(max(lp.logprob for lp in entry.values()), entry[token].logprob)
    again = llm.generate(
        "Once upon a time", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in outs[0].outputs]
    assert pool_whole(llm)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -5),
        ("min_p", 2.0),
        ("max_tokens", 0),
        ("n", 0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 100),
        ("stop", [""]),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_over_long_prompt_is_rejected_and_nothing_leaks(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["hello"] * 2 + ["word " * 9000], SamplingParams(max_tokens=4), use_tqdm=False)
    assert pool_whole(llm)
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_multibyte_text_streams_cleanly(llm):
    outs = llm.generate(
        "Translate to Japanese: good morning ->", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    assert "\ufffd" not in outs[0].outputs[0].text


def test_multi_turn_chat_hits_the_prefix_cache(llm):
    """Each turn re-sends the whole history; from turn 3 on > 90% of the prompt is cached. (With
    16-token blocks the uncached part is the new user turn plus up to one partial block, so the
    rate depends on conversation length; this one has a typical ~150-token system prompt.)"""
    system = (
        "You are a helpful assistant for a pet shop. Answer briefly and kindly. The shop sells food, toys "
        "and accessories for cats, dogs, birds and fish. Opening hours are nine to six on weekdays and "
        "ten to four on Saturdays; the shop is closed on Sundays. Deliveries within the city are free "
        "for orders above thirty euros. If a customer asks about animal health, recommend seeing a "
        "veterinarian. Never invent prices; say that prices are on the website instead."
    )
    messages = [{"role": "system", "content": system}]
    questions = ["What is a cat?", "And a dog?", "Which one is bigger?", "Name a bird.", "Thanks, bye."]
    for turn, q in enumerate(questions, start=1):
        messages.append({"role": "user", "content": q})
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        hit_rate = out.num_cached_tokens / len(out.prompt_token_ids)
        if turn >= 3:
            assert hit_rate > 0.9, f"turn {turn}: {out.num_cached_tokens}/{len(out.prompt_token_ids)} cached"
    assert pool_whole(llm)


def test_shared_params_are_not_mutated_by_the_engine():
    """One SamplingParams object for several prompts with max_tokens=None: each request gets the room
    its own prompt leaves (the core fills in a copy), and the caller's object is left as it was."""
    small = LLM(model="smollm2-135m-instruct", num_kv_blocks=16, max_model_len=40)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompts = [list(range(100, 110)), list(range(200, 230))]
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 10]
    assert params.max_tokens is None


def test_streamed_deltas_add_up_to_the_final_text(llm):
    """Each step carries only its delta (the whole text is built once, at the end: no quadratic work)."""
    engine = llm.engine
    engine.add_request("deltas", "Once upon a time", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sample = out.outputs[0]
            deltas.append(sample.delta_text)
            if out.finished:
                final = sample.text
            else:
                assert sample.text == ""
    assert final and "".join(deltas) == final and pool_whole(llm)


def test_eval_scores_with_the_engine_as_transformers_does(llm, hf_default_model, tokenizer):
    from tokenmill.eval.scorers import EngineScorer
    from tokenmill.eval.tasks import evaluate, texts_to_score

    texts = [t for t, _ in texts_to_score("multiple_choice", EVAL_ITEMS)]
    result = evaluate("multiple_choice", EVAL_ITEMS, EngineScorer(llm).score(texts))
    check_eval_result(result, EVAL_ITEMS, hf_default_model, tokenizer)
    assert pool_whole(llm)


def test_engine_args_defaults_are_the_config_trees_and_the_flags():
    """One set of engine arguments: EngineArgs' defaults build the config tree's defaults, the flags'
    defaults are EngineArgs', and its default model is the loader's."""
    from tokenmill.loader.source import DEFAULT_MODEL

    assert EngineArgs(model=None).create_engine_config() == EngineConfig()
    assert EngineArgs().model == DEFAULT_MODEL
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    flags = parser.parse_args(
        [
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "8",
            "--kv-cache-dtype",
            "int8",
            "--speculative-config",
            '{"method": "ngram"}',
        ]
    )
    keywords = EngineArgs(
        enable_prefix_caching=False,
        scheduling_policy="priority",
        max_num_seqs=8,
        kv_cache_dtype="int8",
        speculative_config={"method": "ngram"},
    )
    assert EngineArgs.from_cli_args(flags).create_engine_config() == keywords.create_engine_config()
    staged = parser.parse_args(["-pp", "2", "--pipeline-layer-partition", "1,2"])
    assert EngineArgs.from_cli_args(staged).create_engine_config().parallel.pipeline_layer_partition == (1, 2)


def test_each_setting_reaches_the_config_fields_of_its_name():
    """`create_engine_config` takes a setting into every config of the tree with a field of its name
    (`from_attributes`), the rest as it says: a value other than the default shows up in each."""
    settings = {  # each other than its default
        "dtype": "float32",
        "seed": 7,
        "quantization": "none",
        "grammar_timeout": 5.0,
        "enforce_eager": True,
        "block_size": 32,
        "enable_prefix_caching": False,
        "prefix_cache_hash": "sha256",
        "kv_cache_dir": "/nowhere",
        "kv_disk_min_load_tokens": 64,
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "distributed_executor_backend": "ray",
        "max_model_len": 256,
        "max_step_ms": 50.0,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 128,
        "kv_cache_dtype": "int8",
        "kv_disk_size": 2.0,
        "scheduling_policy": "priority",
    }
    args = EngineArgs(**settings)
    config = args.create_engine_config()
    for part in (config, config.cache, config.parallel, config.scheduler):
        for name, value in same_named(type(part), args).items():
            assert getattr(part, name) == value, name
    assert (config.cache.cache_dtype, config.cache.kv_disk_size_gib) == ("int8", 2.0)
    assert config.scheduler.policy == "priority"


@dataclasses.dataclass
class _Target:
    a: int = 1
    b: str = "b"
    c: list = dataclasses.field(default_factory=list, init=False)


def test_from_attributes_takes_same_named_attributes_then_values_then_defaults():
    source = argparse.Namespace(a=5, c=[9], other=0)
    assert from_attributes(_Target, source) == _Target(a=5)
    assert from_attributes(_Target, source, a=6, b="x") == _Target(a=6, b="x")
    assert from_attributes(_Target, argparse.Namespace()) == _Target()


def test_a_wrong_engine_argument_is_named_before_anything_loads():
    with pytest.raises(TypeError, match="unknown engine argument.*enable_prefix_cache;"):
        LLM(model="smollm2-135m-instruct", enable_prefix_cache=False)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        LLM(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="kv_role must be one of producer, consumer"):
        LLM(kv_transfer_config={"kv_role": "both"})
    with pytest.raises(ValueError, match="unknown field.*kv_prot"):
        LLM(kv_transfer_config={"kv_role": "producer", "kv_prot": 1})


def test_llm_takes_prefix_caching_and_the_scheduling_policy():
    """Settings the keyword arguments could not reach before EngineArgs: prefix caching off (a repeated
    prompt is computed again) and the priority policy."""
    with LLM(
        model="smollm2-135m-instruct", num_kv_blocks=64, enable_prefix_caching=False, scheduling_policy="priority"
    ) as llm:
        assert isinstance(llm.engine.core.scheduler.waiting, PriorityQueue)
        prompt = {"prompt_token_ids": list(range(100, 140))}
        outs = [llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0] for _ in range(2)]
        assert outs[1].num_cached_tokens == 0
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
