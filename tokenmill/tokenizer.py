"""Tokenizer loading, chat templates, incremental detokenization and stop strings.

Per request::

    detok = IncrementalDetokenizer(tok, prompt_ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output)
    # each step, with the sampled token (not one that ended the request as EOS / a stop token id):
    detok.add_tokens([token_id])      # finished text; on a stop string, cuts output_text and sets stop_str
    if detok.stop_str is not None: finish the request, reason "stop"
    stream detok.stream_delta(finished=request_is_done)   # holds back what may start a stop string
    detok.output_text                 # the whole text, for non-streaming responses
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenmill.loader.source import ModelSource

# End-of-turn markers: if the chat template closes turns with one and it is one token, it stops generation.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_PROMPT_CONTEXT = 5  # prompt tokens the detokenizer decodes with the first output tokens
# Tokens held for an incomplete UTF-8 char before giving up and emitting '\ufffd' (only reached on invalid
# byte soup: encoded text in 8 scripts never has more than 2 tokens in a row ending mid-char).
_MAX_PENDING = 16


class Tokenizer:
    """Thin wrapper around a Hugging Face fast tokenizer (`.hf`)."""

    def __init__(self, hf, name: str, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf
        self.name = name
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)  # includes added tokens
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        eos.update(extra_eos_ids)
        vocab = hf.get_vocab()
        # the most characters of text one token stands for (a byte-level vocabulary's keys hold a character
        # per byte; a sentencepiece one's, a character per character): a bound on what fits a context
        self.max_token_chars: int = max(map(len, vocab), default=1)
        template = hf.chat_template if isinstance(hf.chat_template, str) else ""
        eos.update(vocab[t] for t in _END_OF_TURN if t in template and t in vocab)
        self.eos_token_ids: set[int] = eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` adds BOS only if the model asks for it (SmolLM2 does not)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """The prompt text the model's own chat template makes of `messages`."""
        if not self.hf.chat_template:
            raise ValueError(f"model {self.name!r} has no chat template; send a plain prompt (completions API)")
        return self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs
    ) -> list[int]:
        # The template writes the special tokens (BOS, <|im_start|>) itself, so none are added here.
        text = self.render_chat(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> Tokenizer:
    """Build the tokenizer of a GGUF file (from its metadata) or of an HF checkpoint directory. Never
    downloads. `chat_template` (the operator's) replaces the model's own."""
    if source.kind == "gguf":
        tokenizer = _load_gguf(Path(source.path), source.name)
    elif source.kind == "hf":
        tokenizer = _load_hf(Path(source.path), source.name)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r} for {source.path}")
    if chat_template is not None:
        tokenizer.hf.chat_template = chat_template
        tokenizer = Tokenizer(tokenizer.hf, tokenizer.name, tokenizer.eos_token_ids)  # end-of-turn ids of it
    return tokenizer


def _load_gguf(path: Path, name: str) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer, read_gguf_metadata
    except ImportError:  # older transformers: the slow public path (parses the whole file, ~7 s for SmolLM2)
        return _load_gguf_auto(path, name)
    from transformers import PreTrainedTokenizerFast

    try:
        metadata, _ = read_gguf_metadata(str(path))
        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError("it has no tokenizer.ggml.tokens metadata")
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        # a directory, not the file: beside a large vocabulary transformers looks for a config.json there,
        # and offline it takes a file path for a hub repo id
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend, name_or_path=str(path.parent), **tokenizer_config, **extra
        )
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e
    ids = (metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return Tokenizer(hf, name, (i for i in ids if isinstance(i, int)))


def _load_gguf_auto(path: Path, name: str) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e
    return Tokenizer(hf, name)


def _load_hf(directory: Path, name: str) -> Tokenizer:
    from transformers import AutoTokenizer

    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if not any((directory / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {directory}")
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer in {directory}: {type(e).__name__}: {e}") from e
    extra: set[int] = set()
    for filename in ("generation_config.json", "config.json"):
        file = directory / filename
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"cannot parse {file}: {e}") from e
        extra.update([eos] if isinstance(eos, int) else eos or [])
    return Tokenizer(hf, name, extra)


class StopStringMatcher:
    """Finds stop strings in streamed text. Stops may span token boundaries."""

    def __init__(self, stops: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.max_len = max(map(len, self.stops), default=0)
        # Text that may start a stop string is not streamed yet; when the stop string is kept there is
        # nothing to take back, so nothing is held.
        self.holdback = 0 if self.include else max(self.max_len - 1, 0)

    def find(self, text: str, new_len: int) -> tuple[int, str] | None:
        """For the first stop string to complete inside the last `new_len` chars of `text`,
        `(length to cut text to, stop string)`; None if there is none."""
        best = None
        for stop in self.stops:
            i = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
            if i >= 0 and (best is None or (i + len(stop), i) < (best[0] + len(best[1]), best[0])):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        return (i + len(stop) if self.include else i), stop


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they come, O(1) work per token.

    Decodes a small window (`prefix` tokens already shown + new ones) and emits the text after the
    prefix's own decode, so leading spaces and multi-byte chars come out exactly as a full decode
    would; a window ending in an incomplete UTF-8 char ('\\ufffd') is held until the char completes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopStringMatcher = (),
        include_stop_str_in_output: bool = False,
    ):
        self._backend = tokenizer.hf.backend_tokenizer  # the Rust tokenizer: decode without Python overhead
        self._skip = skip_special_tokens
        if not isinstance(stop, StopStringMatcher):
            stop = StopStringMatcher(stop, include_stop_str_in_output)
        self._stops = stop
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])  # window: [prefix tokens | pending tokens]
        self._read = len(self._ids)  # where pending tokens start
        self._prefix_text = self._decode(self._ids)
        self._chunks: list[str] = []  # finished output text
        self._tail = ""  # last chars of output, enough to find a stop string spanning deltas
        self._unstreamed = ""  # finished text not yet returned by stream_delta
        self.stop_str: str | None = None  # the stop string that ended the output, if any

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def add_tokens(self, new_ids: Iterable[int]) -> str:
        """Feed sampled tokens; return the newly finished text (after any stop-string trim)."""
        if self.stop_str is not None:
            return ""
        out = []
        for token_id in new_ids:  # one at a time: the same deltas however the tokens are batched
            self._ids.append(token_id)
            out.append(self._emit(force=False))
            if self.stop_str is not None:
                break
        return "".join(out)

    def _emit(self, force: bool) -> str:
        text = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if not force and (len(text) <= len(self._prefix_text) or text.endswith("\ufffd")) and pending < _MAX_PENDING:
            return ""  # nothing new, or a char still incomplete
        delta = text[len(self._prefix_text) :]
        # The pending tokens become the next prefix; the window never grows past a few tokens.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._append(delta)

    def _append(self, delta: str) -> str:
        search = self._tail + delta
        hit = self._stops.find(search, len(delta))
        if hit is not None:
            cut, self.stop_str = hit
            if cut < len(self._tail):  # the stop string began in text already added: take it back
                self._drop(len(self._tail) - cut)
            delta = delta[: max(0, cut - len(self._tail))]
            search = search[:cut]
        keep = max(self._stops.max_len - 1, 0)
        self._tail = search[-keep:] if keep else ""
        if delta:
            self._chunks.append(delta)
            self._unstreamed += delta
        return delta

    def _drop(self, n: int) -> None:
        text = self.output_text
        self._chunks[:] = [text[: len(text) - n]]
        # Held back by stream_delta, so never streamed yet (holdback >= len(stop) - 1 >= n).
        self._unstreamed = self._unstreamed[: max(0, len(self._unstreamed) - n)]

    def stream_delta(self, finished: bool = False) -> str:
        """Text to stream now: finished text minus what might begin a stop string. Pass
        `finished=True` on the request's last step to flush everything (incomplete bytes included)."""
        if finished and self.stop_str is None and len(self._ids) > self._read:
            self._emit(force=True)
        hold = 0 if finished or self.stop_str is not None else self._stops.holdback
        n = max(0, len(self._unstreamed) - hold)
        out, self._unstreamed = self._unstreamed[:n], self._unstreamed[n:]
        return out

    @property
    def output_text(self) -> str:
        """All output text so far (cut at the stop string once one is found)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
