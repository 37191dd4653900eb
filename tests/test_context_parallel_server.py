"""Context parallelism through the real server (`tokenmill serve --decode-context-parallel-size 2
--prefill-context-parallel-size 2`): the official `openai` client gets the greedy text of a one-process
server for a prompt prefilled in chunks split over the ranks, streamed or not, and again from the prefix
cache; /metrics counts every token once in the MoE expert counters; a rank that dies is reported by
/health, the engine restarts with both ranks and answers the same. The model is a tiny random Mixtral
with the default model's tokenizer; the two servers start side by side."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from helpers import make_tiny_model
from test_server_utils import ServerProcess, metric_values, model_available

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

PROMPT = "a long document, split over the ranks by token position. " * 8  # chunks of 32 tokens
ARGS = (
    "--served-model-name",
    "tiny",
    "--log-interval",
    "0",
    "--num-kv-blocks",
    "128",
    "--max-num-batched-tokens",
    "32",
)
CONTEXT_PARALLEL = ("--decode-context-parallel-size", "2", "--prefill-context-parallel-size", "2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    """(one-process server, context-parallel server) on the same tiny model."""
    directory = tmp_path_factory.mktemp("tiny-mixtral-cp")
    make_tiny_model("mixtral", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    procs = [
        ServerProcess(tmp_path_factory.mktemp("cp-server"), "--model", str(directory), *ARGS, *extra)
        for extra in ((), CONTEXT_PARALLEL)
    ]
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(ServerProcess.start, procs))
    try:
        yield servers
    finally:
        codes = [srv.stop() for srv in servers]
        assert codes == [0, 0], servers[1].log()


def complete(srv: ServerProcess) -> tuple[str, int, int]:
    r = srv.openai_client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def chat_stream(srv: ServerProcess) -> str:
    chunks = srv.openai_client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def expert_tokens(srv: ServerProcess) -> float:
    """Tokens routed to experts so far, over every MoE layer (each token counts top-k times a layer)."""
    return sum(v for k, v in metric_values(srv.url).items() if k.startswith("tokenmill:moe_expert_tokens_total"))


def test_same_greedy_text_as_one_process_and_prefix_hits(pair):
    one, cp = ([complete(srv), complete(srv), chat_stream(srv)] for srv in pair)  # the same requests on both
    text, prompt_tokens, cached = one[0]
    assert prompt_tokens > 64 and cached == 0
    assert cp == one
    assert cp[1] == (text, prompt_tokens, (prompt_tokens - 1) // 16 * 16)  # again, from the prefix cache
    # the start-up log's KV bytes are one rank's stripe, and say so
    assert "GiB per rank, 2 ranks)" in pair[1].log() and "per rank" not in pair[0].log()


def test_expert_counters_count_each_token_once(pair):
    one, cp = pair
    for srv in pair:  # the same request on both: a prompt split over the ranks, then decodes
        srv.openai_client().completions.create(model="tiny", prompt="x " + PROMPT, max_tokens=4, temperature=0)
    deadline = time.monotonic() + 30  # the counters are read from the ranks between steps
    while expert_tokens(cp) != expert_tokens(one):
        assert time.monotonic() < deadline, (expert_tokens(cp), expert_tokens(one))
        time.sleep(0.2)
    assert expert_tokens(one) > 0


def test_a_dead_rank_is_reported_and_the_engine_restarts_with_both(pair):
    one, cp = pair
    core = psutil.Process(cp.core_pid())
    (rank,) = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]
    rank.kill()
    deadline = time.monotonic() + 60
    while (r := httpx.get(f"{cp.url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "a dead rank was not reported"
        time.sleep(0.1)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 240
    while httpx.get(f"{cp.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.2)
    assert "context-parallel worker rank 1 exited" in cp.log()
    assert complete(cp)[0] == complete(one)[0]
    assert metric_values(cp.url)["tokenmill:engine_restarts_total"] == 1
