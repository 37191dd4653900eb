"""The server's core process builds its engine (weights, KV cache, warm-up) while the front end loads
the tokenizer, and hands the tokenizer's facts over afterwards: `EngineCore.set_tokenizer`; it starts
with its OpenMP threads' spinning bounded."""

from __future__ import annotations

import pytest
from helpers import make_core, make_tiny_model, run_core

from tokenmill.engine.request import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.core_handle import CORE_GOMP_SPINCOUNT, bound_openmp_spinning

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


def test_the_core_spins_less_at_openmp_barriers_unless_the_user_chose():
    """The server bounds its core's OpenMP spinning (GOMP_SPINCOUNT) only where neither OpenMP wait
    setting is given: a user's choice stays as it is, and nothing is added beside it."""
    environ = {"PATH": "/bin"}
    bound_openmp_spinning(environ)
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": CORE_GOMP_SPINCOUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        environ = dict(chosen)
        bound_openmp_spinning(environ)
        assert environ == chosen
