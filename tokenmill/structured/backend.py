"""xgrammar behind three small interfaces: the tokenizer facts it needs, a caching asynchronous grammar
compiler, and a per-request matcher.

* `TokenizerData`: the decoded bytes of every token and the stop tokens; picklable, so the front end
  builds it from the HF tokenizer and hands it to the engine-core process. Building it is cheap (the
  tokenizer's serialized form); the bytes are worked out with xgrammar on first use, off the start path.
* `GrammarCompiler`: `compile_async(spec)` returns a `Future` of the compiled grammar. Compilation runs in
  worker processes under a deadline (`compile_worker.py`), results are kept in an LRU cache keyed by
  `spec.key`, and a second request for a grammar being compiled shares the same future.
* `GrammarMatcher`: the matcher state of one request: `accept(tokens)`, `fill_bitmask(bitmask, row)`,
  `rollback(n)`, `is_terminated()`; for speculative decoding, `validate(tokens)` (how many draft tokens
  the grammar accepts) and `fill_bitmasks_for_draft(...)` (one mask per draft position), both leaving
  the state unchanged, then `accept` the verified tokens or `rollback` the rejected ones.
* `apply_bitmask(logits, bitmask, rows)`: in place, -inf on the tokens a row's bitmask forbids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tokenmill.structured.compile_worker import CompileTimeout, CompileWorkers
from tokenmill.structured.spec import StructuredOutputSpec


class TokenizerData:
    """The decoded bytes of each token id (by id) and the ids that end generation.

    Made at server start from the tokenizer's serialized form and its vocabulary size, which costs
    milliseconds; the bytes themselves come from xgrammar's reading of the vocabulary (byte-level,
    byte-fallback or raw), which needs xgrammar, transformers and about a second, so they are worked
    out on first use: in each compile worker as it starts, and in the engine core when the first grammar
    comes back. Thread-safe; pickles with the bytes once they are known."""

    def __init__(
        self,
        tokenizer_json: str | None,
        vocab_size: int,
        stop_token_ids: list[int],
        decoded_vocab: list[bytes] | None = None,
    ) -> None:
        self.tokenizer_json = tokenizer_json  # a fast tokenizer's `backend_tokenizer.to_str()`
        self.vocab_size = vocab_size  # len(decoded_vocab): the highest token id + 1
        self.stop_token_ids = stop_token_ids
        self._decoded_vocab = decoded_vocab
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenizerData:
        """From a `tokenmill.tokenizer.Tokenizer` (its HF tokenizer and EOS/end-of-turn ids)."""
        hf, stops = tokenizer.hf, sorted(tokenizer.eos_token_ids)
        if getattr(hf, "backend_tokenizer", None) is None:  # a slow tokenizer has no serialized form to defer
            decoded = _decode_vocab(hf, stops)
            return cls(None, len(decoded), stops, decoded)
        vocab = hf.get_vocab()
        return cls(hf.backend_tokenizer.to_str(), max(len(vocab), max(vocab.values()) + 1), stops)

    @property
    def decoded_vocab(self) -> list[bytes]:
        with self._lock:
            if self._decoded_vocab is None:
                from tokenizers import Tokenizer
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.tokenizer_json))
                self._decoded_vocab = _decode_vocab(hf, self.stop_token_ids)
                if len(self._decoded_vocab) != self.vocab_size:
                    raise RuntimeError(
                        f"the tokenizer has {len(self._decoded_vocab)} tokens, expected {self.vocab_size}"
                    )
            return self._decoded_vocab

    def xgrammar_info(self, vocab_size: int):
        """xgrammar's TokenizerInfo for logits `vocab_size` wide (ids past the tokenizer's are never allowed)."""
        import xgrammar as xgr

        return xgr.TokenizerInfo(
            self.decoded_vocab,
            xgr.VocabType.RAW,
            vocab_size=max(vocab_size, self.vocab_size),
            stop_token_ids=self.stop_token_ids,
            add_prefix_space=False,
        )

    def __getstate__(self) -> dict:
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        if state["_decoded_vocab"] is not None:
            state["tokenizer_json"] = None  # not needed any more
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _decode_vocab(hf, stop_token_ids: list[int]) -> list[bytes]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=stop_token_ids or None)
    return [bytes(b) for b in info.decoded_vocab]


@dataclass
class CompileStats:
    num_compiles: int = 0  # grammars compiled (cache misses)
    compile_seconds: float = 0.0  # their total compile time
    last_compile_seconds: float = 0.0
    cache_hits: int = 0


class GrammarCompiler:
    """Compiles specs to xgrammar `CompiledGrammar`s off the caller's thread, with an LRU cache. Making one
    costs nothing on the caller's thread: xgrammar and the worker processes start on the dispatcher threads."""

    def __init__(
        self,
        tokenizer_data: TokenizerData,
        vocab_size: int,
        cache_size: int = 256,
        max_workers: int = 2,
        timeout: float = 30.0,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_data = tokenizer_data
        self._info = None
        self._info_lock = threading.Lock()
        self._workers = CompileWorkers(tokenizer_data, vocab_size, lambda: self.info, max_workers, timeout)
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @property
    def info(self):
        """xgrammar's TokenizerInfo, built on first use (a dispatcher thread, when the first grammar comes back)."""
        with self._info_lock:
            if self._info is None:
                self._info = self._tokenizer_data.xgrammar_info(self.vocab_size)
            return self._info

    def compile_async(self, spec: StructuredOutputSpec) -> Future:
        """A future of the compiled grammar; already done on a cache hit. Failures are not cached."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            future = self._workers.submit(spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # holders of an evicted future keep their reference
        future.add_done_callback(lambda f: self._done(key, f))
        return future

    def compile(self, spec: StructuredOutputSpec):
        """Compile (or fetch from the cache) and wait."""
        return self.compile_async(spec).result()

    def _done(self, key: str, future: Future) -> None:
        with self._lock:
            if future.cancelled() or future.exception() is not None:
                # failures are not cached, except a timeout: the same spec would only time out again
                if self._cache.get(key) is future and not isinstance(future.exception(), CompileTimeout):
                    del self._cache[key]
                return
            seconds = future.compile_seconds
            self.stats.num_compiles += 1
            self.stats.compile_seconds += seconds
            self.stats.last_compile_seconds = seconds

    def shutdown(self) -> None:
        self._workers.shutdown()


class GrammarMatcher:
    """Where one request is in its grammar. Every accepted token is one rollback step."""

    def __init__(self, compiled, stop_token_ids: list[int] | None = None) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)  # unlimited rollback
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self.num_accepted = 0

    def accept(self, tokens: list[int]) -> int:
        """Advance over `tokens`; stops at the first token the grammar rejects. Returns how many were
        accepted (== len(tokens) when all were)."""
        for i, t in enumerate(tokens):
            if not self._m.accept_token(int(t)):
                return i
            self.num_accepted += 1
        return len(tokens)

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar would accept; the state is unchanged."""
        n = self.accept(tokens)
        self.rollback(n)
        return n

    def fill_bitmasks_for_draft(self, bitmask: torch.Tensor, first_row: int, draft: list[int]) -> int:
        """Speculative decoding: rows first_row .. first_row + len(draft) get the masks for each position of
        the draft (after 0, 1, ... of its tokens), stopping early at a draft token the grammar rejects.
        The state is unchanged afterwards. Returns the number of rows filled."""
        accepted = 0
        self.fill_bitmask(bitmask, first_row)
        for i, token in enumerate(draft):
            if self.is_terminated() or self.accept([token]) != 1:
                break
            accepted += 1
            self.fill_bitmask(bitmask, first_row + i + 1)
        self.rollback(accepted)
        return accepted + 1

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)
            self.num_accepted -= n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (1 bit per token)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def allows_nothing(self) -> bool:
        """True when no token (a stop token included) may come next: the grammar's language is empty
        from here on. Checked once when the matcher starts, so such a constraint is refused at admission."""
        if self.is_terminated():
            return False
        bitmask = allocate_bitmask(1, self._vocab_size)
        self.fill_bitmask(bitmask, 0)
        return not bitmask.any()

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the output is complete and must end."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (it may still be extendable)."""
        return self._m.is_completed()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def set_single_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Make `token_id` the only allowed token of `bitmask[row]`."""
    bitmask[row].zero_()
    bit = 1 << (token_id & 31)
    bitmask[row, token_id >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 storage


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in `rows` (in place)."""
    import xgrammar as xgr

    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    else:  # the pure-torch kernel: no Triton or CUDA extension build needed
        bitmask = bitmask.to(logits.device, non_blocking=True)
        try:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="torch_native")
        except TypeError:  # xgrammar < 0.2 has no backend choice
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
