"""Routing policies: which replica gets a request. Pure logic (no I/O), driven by the app.

A policy's `choose(candidates, loads, text)` picks one of `candidates` (indices of the healthy
replicas the request may go to), given every replica's requests in flight (`loads[i]`) and the
request's routing text (the prompt, or the rendered chat messages; None when unknown), and returns
a `Decision` naming the replica and why:

- `round-robin`: the next candidate in turn ("round_robin").
- `least-load`: the candidate with the fewest requests in flight; ties go round in turn ("balanced").
- `prefix` (the default): each replica keeps an approximate record of the texts it was sent (a
  `PrefixTable`: chained hashes of fixed-size character chunks, LRU-bounded). The candidate whose
  record matches the longest leading part of the text wins ("affinity") if that part covers at least
  `match_threshold` of the text and the loads are balanced (max - min in flight over the candidates
  at most `balance_threshold`); otherwise least-load ("balanced"). Either way the text is recorded for
  the chosen replica at once, so a burst of requests sharing a prefix lands on one replica. With a
  shared KV tier (`shared_tier`: the replicas share one `--kv-cache-dir`) a text is also recorded in a
  table for all of them once a replica has answered it (`answered`: its prompt's blocks are then on
  disk for every other; until then the burst still goes where the prefix is being computed): only the
  part of a replica's match beyond that shared record counts for affinity, and a prefix every replica
  can load goes to the least-loaded one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

AFFINITY, BALANCED, ROUND_ROBIN = "affinity", "balanced", "round_robin"
DECISIONS = (AFFINITY, BALANCED, ROUND_ROBIN)

DEFAULT_CHUNK_CHARS = 32
DEFAULT_TABLE_CHARS = 2**22  # per replica: ~1M tokens of text, more than a replica's KV cache holds


@dataclass(frozen=True)
class Decision:
    replica: int
    kind: str  # one of DECISIONS
    match: float = 0.0  # fraction of the text found in the chosen replica's record (prefix policy)


def chunk_keys(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[int]:
    """One key per whole chunk of `text`, each hashing its chunk and every chunk before it (a path in
    a prefix tree): equal keys at position i mean equal first (i + 1) * chunk_chars characters. The
    trailing partial chunk has no key."""
    keys, key = [], 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        key = hash((key, text[start : start + chunk_chars]))
        keys.append(key)
    return keys


class PrefixTable:
    """The chunk keys one replica was sent, least recently used first, at most `max_chunks` of them."""

    def __init__(self, max_chunks: int) -> None:
        if max_chunks < 1:
            raise ValueError(f"a prefix table needs room for at least one chunk, got {max_chunks}")
        self.max_chunks = max_chunks
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading `keys` are in the table."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        """Record a text's keys as just used. The deepest are touched first, so the shared roots stay
        the most recent and eviction takes leaves before the prefixes they hang from."""
        for key in reversed(keys):
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                self._keys[key] = None
        while len(self._keys) > self.max_chunks:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._next = 0

    def _in_turn(self, candidates: Sequence[int]) -> int:
        """The first of `candidates` at or after the turn pointer (cyclically); moves the pointer past it."""
        pick = min(candidates, key=lambda i: (i - self._next) % self.num_replicas)
        self._next = (pick + 1) % self.num_replicas
        return pick

    def choose(self, candidates: Sequence[int], loads: Sequence[int], text: str | None) -> Decision:
        _check(candidates)
        return Decision(self._in_turn(candidates), ROUND_ROBIN)

    def forget(self, replica: int) -> None:
        """The replica lost its cache (it failed): nothing to forget for this policy."""

    def answered(self, text: str | None) -> None:
        """A replica answered a request with this routing text: nothing to learn for this policy."""


class LeastLoadPolicy(RoundRobinPolicy):
    name = "least-load"

    def choose(self, candidates: Sequence[int], loads: Sequence[int], text: str | None) -> Decision:
        _check(candidates)
        fewest = min(loads[i] for i in candidates)
        return Decision(self._in_turn([i for i in candidates if loads[i] == fewest]), BALANCED)


class PrefixPolicy(LeastLoadPolicy):
    name = "prefix"

    def __init__(
        self,
        num_replicas: int,
        match_threshold: float = 0.5,
        balance_threshold: int = 8,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        table_chars: int = DEFAULT_TABLE_CHARS,
        shared_tier: bool = False,
    ) -> None:
        super().__init__(num_replicas)
        if not 0 <= match_threshold <= 1:
            raise ValueError(f"the prefix match threshold must be in [0, 1], got {match_threshold}")
        if balance_threshold < 0:
            raise ValueError(f"the balance threshold must be >= 0, got {balance_threshold}")
        if chunk_chars < 1:
            raise ValueError(f"chunks must hold at least one character, got {chunk_chars}")
        self.match_threshold = match_threshold
        self.balance_threshold = balance_threshold
        self.chunk_chars = chunk_chars
        self.tables = [PrefixTable(max(1, table_chars // chunk_chars)) for _ in range(num_replicas)]
        # every replica's texts: on the shared KV tier, loadable by any replica (None: no shared tier)
        self.shared = PrefixTable(max(1, table_chars // chunk_chars)) if shared_tier else None

    def choose(self, candidates: Sequence[int], loads: Sequence[int], text: str | None) -> Decision:
        _check(candidates)
        if not text:
            return super().choose(candidates, loads, text)
        keys = chunk_keys(text, self.chunk_chars)
        decision = self._affinity(candidates, loads, keys, len(text)) or self._balanced(candidates, loads, keys)
        self.tables[decision.replica].insert(keys)
        return decision

    def answered(self, text: str | None) -> None:
        """A replica answered a request with this routing text: with a shared tier, its prompt's blocks
        are on disk now, loadable by every replica."""
        if self.shared is not None and text:
            self.shared.insert(chunk_keys(text, self.chunk_chars))

    def _affinity(
        self, candidates: Sequence[int], loads: Sequence[int], keys: list[int], length: int
    ) -> Decision | None:
        in_flight = [loads[i] for i in candidates]
        if max(in_flight) - min(in_flight) > self.balance_threshold:
            return None
        everywhere = self.shared.match(keys) if self.shared is not None else 0  # loadable by any replica
        matched = {i: self.tables[i].match(keys) - everywhere for i in candidates}
        best = max(matched.values())
        fraction = best * self.chunk_chars / length
        if best <= 0 or fraction < self.match_threshold:
            return None
        tied = [i for i in candidates if matched[i] == best]
        fewest = min(loads[i] for i in tied)
        return Decision(self._in_turn([i for i in tied if loads[i] == fewest]), AFFINITY, fraction)

    def _balanced(self, candidates: Sequence[int], loads: Sequence[int], keys: list[int]) -> Decision:
        """Least-load; with a shared tier, of the least loaded the one whose own record matches the most
        (its pool may hold what the others would load from disk)."""
        if self.shared is None:
            return LeastLoadPolicy.choose(self, candidates, loads, None)
        fewest = min(loads[i] for i in candidates)
        matched = {i: self.tables[i].match(keys) for i in candidates if loads[i] == fewest}
        best = max(matched.values())
        return Decision(self._in_turn([i for i, n in matched.items() if n == best]), BALANCED)

    def match_fraction(self, replica: int, text: str) -> float:
        """The fraction of `text` the replica's record matches (for inspection and tests)."""
        return (
            self.tables[replica].match(chunk_keys(text, self.chunk_chars)) * self.chunk_chars / len(text)
            if text
            else 0.0
        )

    def forget(self, replica: int) -> None:
        self.tables[replica].clear()


POLICIES = {p.name: p for p in (PrefixPolicy, RoundRobinPolicy, LeastLoadPolicy)}


def make_policy(
    name: str, num_replicas: int, match_threshold: float = 0.5, balance_threshold: int = 8, **prefix_options
):
    """A policy by its CLI name; the thresholds (and `chunk_chars`, `table_chars`) apply to `prefix`."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICIES)}")
    if num_replicas < 1:
        raise ValueError("the router needs at least one replica")
    if name == PrefixPolicy.name:
        return PrefixPolicy(num_replicas, match_threshold, balance_threshold, **prefix_options)
    return POLICIES[name](num_replicas)


def _check(candidates: Sequence[int]) -> None:
    if not candidates:
        raise ValueError("no candidate replica to choose from")
