"""Speculative decoding in a GGUF file's default mode (gguf-q8: the file's blocks, activations rounded to
int8, a float16 KV cache), where greedy output is not transformers' but must still not depend on
speculation: a verify step computes each of its rows as a decode step computes its one token (every
new token a decode row of the paged kernel, the compiled decode step, linears on panels whose result
for a row does not depend on the rows beside it), so the tokens and their logprobs are the same to the
bit with speculation on and off."""

from __future__ import annotations

import pytest
from helpers import make_core, make_tiny_model, write_tiny_gguf
from test_spec_decode import SPEC, repetitive_prompts

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

# 4-, 5- and 8-bit codes in blocks of 32, as real files mix them: gguf-q8 runs every one on panels at
# every step size, so a row's bits do not depend on whether it shares a step with a prompt chunk (with
# the 8-bit layers dequantized for a float GEMM past 128 rows, as before, this test failed). Q6_K needs
# rows of 256 values, more than this tiny model has.
TYPES = {
    "attn_q": "Q4_1",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q8_0",
    "ffn_gate": "Q5_0",
    "ffn_up": "Q5_0",
    "ffn_down": "Q4_0",
    "output": "Q8_0",
    "token_embd": "Q8_0",
}


@pytest.fixture(scope="module")
def gguf_q8(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf_q8")
    write_tiny_gguf(make_tiny_model("llama-gqa-untied", directory), directory / "m.gguf", TYPES)
    loaded = load_model(str(directory / "m.gguf"))
    assert loaded.quantization == "gguf-q8"
    return str(directory / "m.gguf"), loaded


ARRIVAL = 8  # the step at which the other requests arrive


def generate(core, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[tuple[int, float]]]:
    """Each request's (token, logprob) pairs. The first request runs alone for its first steps (decodes
    of one row, verify steps of several), then the others arrive: their prompts are prefilled in a step
    that also decodes or verifies the first (run layer by layer, not by the compiled decode step), and
    the steps after it hold several requests' decode and verify rows."""
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    core.add_request(EngineCoreRequest("0", prompts[0], params))
    steps = 0
    while core.has_unfinished() or steps <= ARRIVAL:
        if steps == ARRIVAL:
            for i, prompt in enumerate(prompts[1:], 1):
                core.add_request(EngineCoreRequest(str(i), prompt, params))
        for o in core.step():
            out[o.request_id] += [(t, lp[t].logprob) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
        steps += 1
    return out


def test_greedy_tokens_and_logprobs_are_identical_with_speculation(gguf_q8):
    path, loaded = gguf_q8
    prompts = repetitive_prompts(6, length=40)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    # a fixed step budget: both runs prefill every prompt in one chunk (gguf-q8's prefill attention
    # rounds differently where a prompt is cut, and the default budget cuts by the time steps took)
    plain = generate(make_core(path, block_size=8, loaded=loaded, max_step_ms=0), prompts, params)
    core = make_core(path, block_size=8, loaded=loaded, speculative=SPEC, max_step_ms=0)
    spec = generate(core, prompts, params)
    assert spec == plain  # the tokens, and each one's logprob to the bit
    stats = core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected
    assert core.kv.num_free_blocks == core.kv.num_blocks
