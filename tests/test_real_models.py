"""Real GGUF models from `../shared/models/fetch.sh` (cached after the first fetch) against transformers
loading the same file in float32: logits closely, greedy tokens exactly (with the tie rule).

- gemma-3-270m (Q4_K_M: Q4_K/Q5_0/Q6_K/Q8_0): sliding-window layers (window 512) between global ones,
  QK-norm, GeGLU; one prompt longer than the window, prefilled in chunks across its boundary.
- qwen2.5-coder-0.5b (Q4_K_M mix: Q5_0/Q8_0/Q6_K/Q4_K).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import all_logits, assert_greedy_of, hf_from_gguf, make_core, make_runner, run_core

from tokenmill.loader import load_model
from tokenmill.loader.source import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import load_tokenizer

FETCH = Path(__file__).resolve().parents[2] / "shared" / "models" / "fetch.sh"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time"]


@pytest.fixture(scope="module", params=["gemma-3-270m", "qwen2.5-coder-0.5b"])
def real(request, tmp_path_factory):
    if not FETCH.is_file():
        pytest.skip(f"{FETCH} is not here (the shared models folder)")
    path = Path(
        subprocess.run(["bash", str(FETCH), request.param], check=True, capture_output=True, text=True, timeout=1800)
        .stdout.strip()
        .splitlines()[-1]
    )
    hf = hf_from_gguf(path, tmp_path_factory.mktemp(request.param))
    loaded = load_model(str(path), dtype="float32")  # the exact mode
    yield request.param, str(path), loaded, hf, load_tokenizer(resolve_model(str(path)))
    del hf, loaded


def test_logits_match_transformers(real):
    name, _, loaded, hf, tok = real
    prompts = [tok.encode(p) for p in PROMPTS]
    if name.startswith("gemma"):  # past the sliding window (512) of its local layers
        prompts.append(tok.encode(" ".join(f"item {i}," for i in range(200)))[:600])
        assert len(prompts[-1]) == 600
    runner = make_runner(loaded, num_blocks=64)
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        diff = (all_logits(runner, ids) - ref).abs().max().item()
        assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), f"{name}: {len(ids)} tokens, max |diff| {diff}"


def test_greedy_matches_transformers(real):
    name, path, loaded, hf, tok = real
    prompts = [tok.encode(p) for p in PROMPTS]
    if name.startswith("gemma"):  # prefilled in chunks of 256 across the window boundary, then decoded past it
        prompts.append(tok.encode(" ".join(f"item {i}," for i in range(200)))[:500])
    core = make_core(path, loaded=loaded, num_blocks=128, max_num_batched_tokens=256)
    out = run_core(core, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for i, ids in enumerate(prompts):
        assert_greedy_of(hf, ids, out[str(i)], 24)
