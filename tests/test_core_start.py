"""The server's core process builds its engine (weights, KV cache, warm-up) while the front end loads
the tokenizer, and hands the tokenizer's facts over afterwards: `EngineCore.set_tokenizer`."""

from __future__ import annotations

import pytest
from helpers import make_core, make_tiny_model, run_core

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

PROMPT = [5, 9, 14, 3]


def test_end_of_sequence_ids_given_after_the_build_stop_requests(tmp_path):
    make_tiny_model("llama-gqa-untied", tmp_path)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    (plain,) = run_core(make_core(str(tmp_path), num_blocks=16), [PROMPT], greedy).values()
    core = make_core(str(tmp_path), num_blocks=16)
    core.set_tokenizer({plain[1]})
    (stopped,) = run_core(core, [PROMPT], greedy).values()
    assert stopped == plain[:2]  # ends at the second token, now an end-of-sequence id
    core.add_request(EngineCoreRequest("late", PROMPT, greedy))
    with pytest.raises(RuntimeError, match="in flight"):
        core.set_tokenizer(set())
    core.abort_requests(["late"])
