"""The KV cache's disk tier on real servers (`tokenmill serve --kv-cache-dir`): a server started after
another has gone answers that server's prompt from disk, with the same tokens; two servers on one
directory write the same blocks at once without harm and answer each other's prompts from it. The
model is a tiny random Llama with the default model's tokenizer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import make_tiny_model
from test_server_utils import ServerProcess, metric_values, model_available

from tokenmill.kv_transfer.block_files import SUFFIX

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

BLOCK = 16
TEXT = "tool definitions and instructions, resent every turn. " * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-llama-disk-tier")
    make_tiny_model("llama-gqa-untied", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    return directory


def servers(tmp_path_factory, model_dir, cache_dir, n: int) -> list[ServerProcess]:
    args = ("--model", str(model_dir), "--kv-cache-dir", str(cache_dir), "--kv-disk-min-load-tokens", "16")
    args += ("--served-model-name", "tiny", "--log-interval", "0")
    procs = [ServerProcess(tmp_path_factory.mktemp("disk-tier-server"), *args) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:  # they start side by side
        return list(pool.map(ServerProcess.start, procs))


def complete(srv: ServerProcess, prompt: str) -> tuple[str, int]:
    r = srv.openai_client().completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens


def wait_for_blocks(cache_dir, n: int) -> None:
    """Until the background writers have put `n` block files in the directory."""
    deadline = time.monotonic() + 60
    while len(list(cache_dir.glob(f"*{SUFFIX}"))) < n:
        assert time.monotonic() < deadline, "the blocks were not written"
        time.sleep(0.05)


def disk(srv: ServerProcess, key: str) -> float:
    return metric_values(srv.url).get(f'tokenmill:kv_tier_{key}_total{{tier="disk"}}', 0.0)


def test_a_restarted_server_and_a_second_replica_answer_from_disk(tmp_path_factory, model_dir, tmp_path):
    (first,) = servers(tmp_path_factory, model_dir, tmp_path, 1)
    try:
        text, num_tokens = complete(first, "P " + TEXT)
        wait_for_blocks(tmp_path, num_tokens // BLOCK)
    finally:
        assert first.stop() == 0
    a, b = servers(tmp_path_factory, model_dir, tmp_path, 2)
    try:
        assert complete(a, "P " + TEXT) == (text, num_tokens)  # from the files the stopped server wrote
        assert disk(a, "hits") == (num_tokens - 1) // BLOCK * BLOCK
        with ThreadPoolExecutor(2) as pool:  # both write the same blocks at once
            same = list(pool.map(complete, (a, b), ["Q " + TEXT] * 2))
        assert same[0] == same[1]
        wait_for_blocks(tmp_path, num_tokens // BLOCK + same[0][1] // BLOCK)
        hits = disk(b, "hits")
        assert complete(b, "P " + TEXT) == (text, num_tokens)  # a prompt only the other servers ran
        assert disk(b, "hits") - hits == (num_tokens - 1) // BLOCK * BLOCK
        assert httpx.post(f"{a.url}/reset_prefix_cache").status_code == 200
        hits = disk(a, "hits")  # the side-by-side run may already have read some of the other's blocks
        assert complete(a, "Q " + TEXT) == same[0]  # from the files both wrote
        assert disk(a, "hits") - hits == (same[0][1] - 1) // BLOCK * BLOCK
        assert disk(a, "bad_files") == disk(b, "bad_files") == 0
    finally:
        assert a.stop() == 0 and b.stop() == 0
