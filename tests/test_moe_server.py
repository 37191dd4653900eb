"""A mixture-of-experts model served for real: routing statistics in /metrics (tokens per expert per
layer, load imbalance) and in `tokenmill bench` results. The model is a tiny random-weight Qwen3-MoE
with the default model's vocabulary and tokenizer, so the server can tokenize text for it."""

from __future__ import annotations

import pytest
from helpers import make_tiny_model
from test_server_utils import metric_values, model_available, running_server

from tokenmill.bench import prometheus, report
from tokenmill.bench.cli import main as bench_main

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe")
    hf = make_tiny_model("qwen3-moe", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    srv_args = (
        "--model",
        str(directory),
        "--served-model-name",
        "tiny-moe",
        "--no-enable-prefix-caching",
        "--log-interval",
        "0",
    )
    for srv in running_server(tmp_path_factory, "moe-server", *srv_args):
        yield srv, hf.config


def routed(url: str) -> dict[str, dict[str, float]]:
    return prometheus.expert_tokens(prometheus.scrape(f"{url}/metrics"))


def test_metrics_count_tokens_per_expert_and_layer(moe_server):
    srv, config = moe_server
    client = srv.openai_client()
    before = routed(srv.url)
    forwarded = 0
    for prompt in ("The quick brown fox", "Once upon a time, in a land far away,"):
        r = client.completions.create(
            model="tiny-moe", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        forwarded += r.usage.prompt_tokens + r.usage.completion_tokens - 1  # the last token is never fed
    after = routed(srv.url)
    assert sorted(after, key=int) == [str(i) for i in range(config.num_hidden_layers)]
    for layer, counts in after.items():
        assert len(counts) == config.num_experts
        delta = sum(counts.values()) - sum(before.get(layer, {}).values())
        assert delta == forwarded * config.num_experts_per_tok
    values = metric_values(srv.url)
    for layer, counts in after.items():  # the gauge is over everything since the engine started
        c = list(counts.values())
        assert values[f'tokenmill:moe_load_imbalance{{layer="{layer}"}}'] == pytest.approx(max(c) * len(c) / sum(c))


def test_bench_reports_the_load_imbalance_of_the_run(moe_server, tmp_path):
    srv, config = moe_server
    result_file = tmp_path / "moe.json"
    before = routed(srv.url)
    bench_main(
        [
            "serve",
            "--base-url",
            srv.url,
            "--model",
            "tiny-moe",
            "--disable-tqdm",
            "--num-prompts",
            "4",
            "--random-input-len",
            "12",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--tokenizer",
            str(srv.args[1]),
            "--result-file",
            str(result_file),
        ]
    )
    after = routed(srv.url)
    moe = report.load_json(result_file)["server_metrics"]["moe"]
    assert moe["moe_layers"] == config.num_hidden_layers
    want = [
        [after[layer][e] - before.get(layer, {}).get(e, 0) for e in sorted(after[layer], key=int)]
        for layer in sorted(after, key=int)
    ]
    assert moe["routed_tokens"] == sum(map(sum, want))
    assert moe["load_imbalance_per_layer"] == pytest.approx([max(c) * len(c) / sum(c) for c in want])
    assert moe["load_imbalance_max"] == max(moe["load_imbalance_per_layer"]) >= 1.0
