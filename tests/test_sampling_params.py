"""Validation and normalisation of SamplingParams."""

import pytest

from tokenmill.sampling_params import SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and p.temperature == 1.0
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


def test_normalisation_and_greedy():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.top_k == 0
    assert p.greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_valid_edge_values():
    SamplingParams(
        temperature=0,
        top_p=1,
        top_k=5,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.5,
        seed=0,
        max_tokens=None,
        min_tokens=4,
        logprobs=0,
    )
    SamplingParams(max_tokens=1, min_tokens=1, logprobs=20, temperature=2)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("n", "2"),
        ("temperature", -1),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 1e39),  # inf as a float32: a masked token's -inf / inf is NaN
        ("temperature", 1e308),
        ("top_p", 0),
        ("top_p", 1.1),
        ("top_p", -0.5),
        ("top_p", None),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", False),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", "0"),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3),
        ("presence_penalty", True),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1),
        ("repetition_penalty", None),
        ("repetition_penalty", 1e-300),  # a logit / ~0: inf
        ("repetition_penalty", 1e-37),
        ("repetition_penalty", 1e38),  # a negative logit x 1e38: -inf, on every token a prompt holds
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("min_tokens", 17),  # > default max_tokens 16
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["1"]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("logprobs", True),
        ("skip_special_tokens", None),
        ("include_stop_str_in_output", 0),
    ],
)
def test_invalid_field_raises_naming_field(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert str(exc.value).startswith(field + " ")


def test_messages():
    with pytest.raises(ValueError, match=r"^temperature must be in \[0, 3e\+38\] \(a float32\), got -1$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0)


def test_min_tokens_vs_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
