"""`tokenmill doctor --probe` against deliberately misconfigured real servers (a tiny random-weight
Llama with the default model's tokenizer): each must get the diagnosis of its misconfiguration, with
the flag to change. Four servers start together; each is probed briefly and stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import make_tiny_model
from test_server_utils import ServerProcess, free_port, model_available

from tokenmill.entrypoints.cli import main

pytestmark = pytest.mark.skipif(not model_available(), reason="the default model's tokenizer is not installed")

CASES = {  # name -> (serve flags, the finding it must get, findings it must not get)
    "tiny-pool": (
        ("--num-kv-blocks", "6", "--max-model-len", "auto"),  # auto: the 96 tokens one sequence fits
        "kv_pool_too_small",
        {"max_num_seqs_too_low", "prefix_cache_missed"},
    ),
    "prefix-off": (("--no-enable-prefix-caching",), "prefix_cache_missed", {"kv_pool_too_small"}),
    "one-seq": (("--max-num-seqs", "1"), "max_num_seqs_too_low", {"kv_pool_too_small", "prefix_cache_missed"}),
    "tiny-chunk": (("--max-num-batched-tokens", "16"), "prefill_chunk_too_small", {"kv_pool_too_small"}),
}
PROBE = ("--probe", "--concurrency", "4", "--probe-output-tokens", "8", "--probe-long-prompt", "256", "--json")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("doctor-tiny")
    make_tiny_model("llama-gqa-untied", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model):
    directory = tiny_model
    log_dir = tmp_path_factory.mktemp("doctor-logs")
    procs = {
        name: ServerProcess(log_dir, "--model", str(directory), "--log-interval", "0", "--disable-log-requests", *flags)
        for name, (flags, _, _) in CASES.items()
    }
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(ServerProcess.start, procs.values()))
        yield procs
    finally:
        for srv in procs.values():
            srv.stop()


@pytest.mark.parametrize("case", CASES)
def test_each_misconfiguration_gets_its_diagnosis(servers, case, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no hardware record: no roofline in this test
    srv = servers[case]
    _, expected, absent = CASES[case]
    for _ in range(3):  # a probe the busy machine stalled (its timings then say little) is taken again
        main(["doctor", "--base-url", srv.url, *PROBE])
        out = json.loads(capsys.readouterr().out)
        found = {f["id"]: f for f in out["findings"]}
        if expected in found:
            break
    srv.stop()  # the next case's probe has the CPU to itself
    assert expected in found, (out["findings"], out["probe"], out["window"])
    assert not absent & set(found), out["findings"]
    finding = found[expected]
    assert finding["evidence"] and finding["advice"]
    flag = {
        "kv_pool_too_small": "--kv-cache-memory",
        "prefix_cache_missed": "--enable-prefix-caching",
        "max_num_seqs_too_low": "--max-num-seqs",
        "prefill_chunk_too_small": "--max-num-batched-tokens",
    }[expected]
    assert any(flag in line for line in finding["advice"]), finding
    assert out["engine"]["model_path"] and out["probe"]["failed_requests"] == 0
    if case == "tiny-pool":
        assert out["engine"]["max_model_len"] == "96" and out["probe"]["context_limit"] == 96


def test_serve_refuses_a_max_model_len_the_pool_cannot_hold(tiny_model):
    flags = ("--model", str(tiny_model), "--port", str(free_port()), "--num-kv-blocks", "4", "--max-model-len", "512")
    run = subprocess.run(
        [sys.executable, "-m", "tokenmill.server.cli", "serve", *flags], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 1, run.stderr
    assert "--max-model-len 512 does not fit: the KV cache holds 64 tokens of one sequence" in run.stderr
    assert "--kv-cache-memory" in run.stderr and "--max-model-len 64 or auto" in run.stderr
