"""xgrammar behind three small interfaces: the tokenizer facts it needs, a caching asynchronous grammar
compiler, and a per-request matcher.

* `TokenizerData`: the decoded bytes of every token and the stop tokens; picklable, so the front end
  builds it from the HF tokenizer and hands it to the engine-core process.
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


@dataclass
class TokenizerData:
    """The decoded bytes of each token id (by id) and the ids that end generation."""

    decoded_vocab: list[bytes]
    stop_token_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenizerData:
        """From a `tokenmill.tokenizer.Tokenizer` (its HF tokenizer and EOS/end-of-turn ids)."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, stop_token_ids=sorted(tokenizer.eos_token_ids))
        return cls([bytes(b) for b in info.decoded_vocab], list(info.stop_token_ids))

    def xgrammar_info(self, vocab_size: int):
        """xgrammar's TokenizerInfo for logits `vocab_size` wide (ids past the tokenizer's are never allowed)."""
        import xgrammar as xgr

        return xgr.TokenizerInfo(self.decoded_vocab, xgr.VocabType.RAW,
                                 vocab_size=max(vocab_size, len(self.decoded_vocab)),
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=False)


@dataclass
class CompileStats:
    num_compiles: int = 0  # grammars compiled (cache misses)
    compile_seconds: float = 0.0  # their total compile time
    last_compile_seconds: float = 0.0
    cache_hits: int = 0


class GrammarCompiler:
    """Compiles specs to xgrammar `CompiledGrammar`s off the caller's thread, with an LRU cache."""

    def __init__(self, tokenizer_data: TokenizerData, vocab_size: int, cache_size: int = 256,
                 max_workers: int = 2, timeout: float = 30.0) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_data.xgrammar_info(vocab_size)
        self._workers = CompileWorkers(tokenizer_data, vocab_size, self.info, max_workers, timeout)
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

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
