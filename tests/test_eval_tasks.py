"""`tokenmill eval` task files and metrics, on hand-made scores (no model)."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.eval.tasks import CORPUS, Scored, corpus_items, evaluate, load_task, texts_to_score


def write(tmp_path, lines: list) -> str:
    path = tmp_path / "task.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    "item, kind",
    [
        ({"context": "a", "choices": ["b", "c"], "gold": 0}, "multiple_choice"),
        ({"context": "a", "continuation": "b"}, "loglikelihood"),
        ({"text": "a b"}, "perplexity"),
    ],
)
def test_the_kind_is_told_from_the_fields(tmp_path, item, kind):
    assert load_task(write(tmp_path, [item, "", item])) == (kind, [item, item])


@pytest.mark.parametrize(
    "lines, kind, message",
    [
        (["{not json"], "auto", "task.jsonl:1: not JSON"),
        ([{"prompt": "x"}], "auto", "cannot tell the task kind"),
        (
            [{"context": "a", "choices": ["b"], "gold": 0}, {"context": "a", "choices": ["b"]}],
            "auto",
            "item 2 has no gold",
        ),
        ([{"text": "a"}], "ranking", "task kind must be one of"),
        ([], "auto", "no items"),
    ],
)
def test_bad_task_files_are_named(tmp_path, lines, kind, message):
    with pytest.raises(ValueError, match=message):
        load_task(write(tmp_path, lines), kind)


def test_multiple_choice_picks_the_most_likely_choice_and_normalises_by_length():
    items = [{"context": "Q:", "choices": [" a", " bbbbbbbb"], "gold": 1}]
    texts = texts_to_score("multiple_choice", items)
    assert texts == [("Q: a", 2), ("Q: bbbbbbbb", 2)]
    # the context is token 0 (offset 0); each choice one token at offset 2
    scored = [Scored([0, 2], [None, -1.0], [False, True]), Scored([0, 2], [None, -4.0], [False, False])]
    result = evaluate("multiple_choice", items, scored)
    assert (result["acc"], result["acc_norm"]) == (0.0, 1.0)  # -1/2 < -4/9: length normalisation flips it
    assert result["per_item"][0]["loglikelihoods"] == [-1.0, -4.0]


def test_loglikelihood_sums_the_continuation_tokens_only():
    items = [{"context": "ab", "continuation": "cd"}]
    scored = [Scored([0, 1, 2, 3], [None, -9.0, -1.0, -2.0], [False, False, True, False])]
    result = evaluate("loglikelihood", items, scored)
    assert result["per_item"] == [{"loglikelihood": -3.0, "is_greedy": False, "tokens": 2}]


def test_a_continuation_merged_into_the_context_token_is_an_error():
    scored = [Scored([0], [None], [False])]
    with pytest.raises(ValueError, match="no tokens of its own"):
        evaluate("loglikelihood", [{"context": "ab", "continuation": "c"}], scored)


def test_perplexity_over_every_scored_token():
    items = [{"text": "one two"}, {"text": "three"}]
    scored = [Scored([0, 3], [None, -2.0], [False, False]), Scored([0, 2, 4], [None, -1.0, -3.0], [False] * 3)]
    result = evaluate("perplexity", items, scored)
    assert math.isclose(result["token_perplexity"], math.exp(6.0 / 3))
    assert math.isclose(result["word_perplexity"], math.exp(6.0 / 3))  # three words


def test_the_corpus_is_cut_into_whole_lines_in_order():
    items = corpus_items(chunk_chars=1500)
    text = CORPUS.read_text()
    assert "".join(i["text"] for i in items) == text and len(items) > 10
    assert all(len(i["text"]) <= 1500 or i["text"].count("\n") <= 1 for i in items)
    assert all(i["text"].endswith("\n") for i in items[:-1])
    with pytest.raises(ValueError, match="chunk_chars must be positive"):
        corpus_items(chunk_chars=0)
