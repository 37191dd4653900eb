"""Mixture-of-experts and latent-attention (MLA) models over two real processes (gloo on 127.0.0.1):
under tensor parallelism (each expert split by its intermediate features, MLA by heads) and under
expert parallelism (whole experts per rank, tokens sent to them and back by all-to-all) the greedy
tokens are one process's; the routing counts per rank cover every routed token, in the engine, on
a served engine's /metrics and in `tokenmill bench` results; expert counts that do not divide and dense models are refused clearly."""

from __future__ import annotations

import pytest
from helpers import make_tiny_model, write_tiny_gguf
from test_server_utils import metric_values, model_available, running_server
from test_tensor_parallel import PROMPTS, TOKENS, parallel_runs, run_parallel, single_tokens

from tokenmill.bench import prometheus, report
from tokenmill.bench.cli import main as bench_main
from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.executor import executor_for

TWO_RANK_MODELS = [
    ("qwen2-moe", "tp"),  # a gated shared expert and a dense layer beside the routed one
    ("qwen2-moe", "ep"),
    ("deepseek-v2", "tp"),  # MLA (queries straight from the hidden state) + routed and shared experts
    ("deepseek-v2", "ep"),
    ("deepseek-v2-yarn", "tp"),  # low-rank queries split by heads, group-limited routing, 2 shared experts
    ("deepseek-v3", "ep"),  # sigmoid routing with a correction bias, 8 experts: 4 per rank
    ("gpt-oss", "tp"),  # sinks split by heads; expert biases (the down bias added once over the ranks)
    ("gpt-oss", "ep"),
]
GGUF_MODELS = [("deepseek-v2", "tp"), ("qwen3-moe", "ep")]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Each model of this module's comparisons and its two-rank run (all in one driver process):
    (name, mode, "hf" or "gguf") -> (path, transformers config, tokens, routing statistics)."""
    cases, hf_dirs = {}, {}
    for name, mode in TWO_RANK_MODELS:
        if name not in hf_dirs:
            directory = tmp_path_factory.mktemp(name)
            hf_dirs[name] = (str(directory), make_tiny_model(name, directory).config)
        cases[name, mode, "hf"] = hf_dirs[name]
    for name, mode in GGUF_MODELS:
        # llama.cpp's layout: a layer's experts in one Q8_0 tensor each for gate, up and down
        hf = make_tiny_model(name, tmp_path_factory.mktemp(f"{name}-hf"))
        path = tmp_path_factory.mktemp(f"{name}-gguf") / "m.gguf"
        write_tiny_gguf(hf, path, {"ffn_up_exps": "Q8_0", "ffn_down_exps": "Q8_0", "ffn_gate_exps": "Q8_0"})
        cases[name, mode, "gguf"] = (str(path), hf.config)
    runs = parallel_runs([(path, "float32", mode) for (_, mode, _), (path, _) in cases.items()])
    return {key: (*case, *run) for (key, case), run in zip(cases.items(), runs)}


@pytest.mark.parametrize("name,mode", TWO_RANK_MODELS)
def test_two_ranks_give_the_greedy_tokens_of_one(two_rank_runs, name, mode):
    path, config, tokens, stats = two_rank_runs[name, mode, "hf"]
    assert tokens == single_tokens(path)
    forwarded = sum(len(p) + TOKENS - 1 for p in PROMPTS)  # the last sampled token is never fed
    expert_tokens = stats["expert_tokens"]
    for counts in expert_tokens.values():
        assert sum(counts) == forwarded * config.num_experts_per_tok
    if mode == "ep":  # rank r holds experts [r * E/2, (r + 1) * E/2)
        half = len(next(iter(expert_tokens.values()))) // 2
        assert stats["moe_rank_tokens"] == [
            sum(sum(c[:half]) for c in expert_tokens.values()),
            sum(sum(c[half:]) for c in expert_tokens.values()),
        ]
    else:
        assert stats["moe_rank_tokens"] == []


@pytest.mark.parametrize("name,mode", GGUF_MODELS)
def test_gguf_stacked_experts_split_by_features_and_by_experts(two_rank_runs, name, mode):
    """llama.cpp's layout: a layer's experts in one Q8_0 tensor each for gate, up and down (sliced by
    rows / columns under TP, by experts under EP), DeepSeek's latent projection as k_b and v_b."""
    path, _, tokens, _ = two_rank_runs[name, mode, "gguf"]
    assert tokens == single_tokens(path)


def test_expert_count_that_does_not_divide_is_refused(tmp_path):
    make_tiny_model("mixtral", tmp_path, num_local_experts=3)
    done = run_parallel([(str(tmp_path), "float32", "ep")])
    assert done.returncode != 0
    assert (
        "3 experts do not split over 2 ranks (--enable-expert-parallel needs a multiple of "
        "--tensor-parallel-size)" in done.stderr
    )


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path):
    make_tiny_model("llama-gqa-untied", tmp_path)
    config = EngineConfig(model=str(tmp_path), dtype="float32", parallel=ParallelConfig(enable_expert_parallel=True))
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM is a dense model"):
        executor_for(config)


@pytest.fixture(scope="module")
def ep_server(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-ep")
    hf = make_tiny_model("qwen3-moe", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    args = (
        "--model",
        str(directory),
        "--served-model-name",
        "tiny-ep",
        "--tensor-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--log-interval",
        "0",
    )
    for srv in running_server(tmp_path_factory, "ep-server", *args):
        yield srv, hf.config


@pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")
def test_metrics_count_tokens_per_rank(ep_server):
    srv, config = ep_server
    client = srv.openai_client()
    forwarded = 0
    for prompt in ("The quick brown fox", "Once upon a time, in a land far away,"):
        r = client.completions.create(
            model="tiny-ep", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        forwarded += r.usage.prompt_tokens + r.usage.completion_tokens - 1
    values = metric_values(srv.url)
    ranks = [values[f'tokenmill:moe_rank_tokens_total{{rank="{r}"}}'] for r in range(2)]
    assert sum(ranks) == forwarded * config.num_experts_per_tok * config.num_hidden_layers
    half = config.num_experts // 2
    for rank, count in enumerate(ranks):  # rank r's experts: [r * half, (r + 1) * half)
        assert count == sum(
            values[f'tokenmill:moe_expert_tokens_total{{expert="{e}",layer="{layer}"}}']
            for layer in range(config.num_hidden_layers)
            for e in range(rank * half, (rank + 1) * half)
        )
    assert values["tokenmill:moe_rank_imbalance"] == pytest.approx(max(ranks) * 2 / sum(ranks))


@pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")
def test_bench_reports_the_tokens_per_rank_of_the_run(ep_server, tmp_path):
    srv, _ = ep_server
    result_file = tmp_path / "ep.json"
    before = prometheus.rank_tokens(prometheus.scrape(f"{srv.url}/metrics"))
    bench_main(
        [
            "serve",
            "--base-url",
            srv.url,
            "--model",
            "tiny-ep",
            "--disable-tqdm",
            "--num-prompts",
            "3",
            "--random-input-len",
            "12",
            "--random-output-len",
            "3",
            "--ignore-eos",
            "--tokenizer",
            str(srv.args[1]),
            "--result-file",
            str(result_file),
        ]
    )
    after = prometheus.rank_tokens(prometheus.scrape(f"{srv.url}/metrics"))
    moe = report.load_json(result_file)["server_metrics"]["moe"]
    assert moe["rank_tokens"] == [after[r] - before[r] for r in ("0", "1")]
    assert sum(moe["rank_tokens"]) == moe["routed_tokens"]
    assert moe["rank_imbalance"] == pytest.approx(max(moe["rank_tokens"]) * 2 / moe["routed_tokens"])
