"""KV cache manager: a pool of fixed-size blocks, per-request block tables, reference counts, and
the automatic prefix cache.

The pool is created once; blocks never move. Free blocks wait in a doubly linked queue (O(1) pop
from the front, append at the back, removal from the middle). A full block's key hashes its parent
block's key with its token ids (the request's cache salt stands in for the parent of the first
block), so a key names the whole prefix up to that block. Freed blocks keep their content and key
while they sit in the free queue; a new request whose prefix matches takes them back, and
allocation evicts the least recently freed first. On a hit the stored token ids *and* parent key
are compared too, so the whole chain back to the salt must match: even a hash collision can never
hand one prompt another prompt's KV. The default key is a keyed BLAKE2b (a random key per
process), so clients cannot craft collisions either.

A manager serves one pool (`kv_cache_coordinator.py` joins them). With a sliding window (every
layer on this pool attends only to the last `sliding_window` positions), a request's blocks that fall
wholly out of the window are returned to the pool as it advances; their places in its block table
keep block id 0 (never read: the window masks them), so a sequence holds at most about window +
block_size + its new tokens of KV here.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence

from tokenmill.engine.request import Request

BlockKey = Hashable
HashFn = Callable[[object, Sequence[int]], BlockKey]  # (parent key or salt, block token ids) -> key

_PROCESS_KEY = os.urandom(32)


def blake2b_hash(parent: object, tokens: Sequence[int]) -> bytes:
    """Keyed BLAKE2b (128 bits) with a per-process random key: collision-resistant and unpredictable."""
    head = parent if isinstance(parent, bytes) else ("" if parent is None else f"salt:{parent}").encode()
    h = hashlib.blake2b(key=_PROCESS_KEY, digest_size=16)
    h.update(len(head).to_bytes(4, "little"))
    h.update(head)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def sha256_hash(parent: object, tokens: Sequence[int]) -> bytes:
    """Unkeyed SHA-256: the same key in every process (for caches shared between processes)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(tokens)), protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin_hash(parent: object, tokens: Sequence[int]) -> int:
    """Python's tuple hash: the fastest, but 64-bit and predictable (collisions can be crafted; the
    chain check still keeps them from serving wrong KV)."""
    return hash((parent, tuple(tokens)))


HASH_FUNCTIONS: dict[str, HashFn] = {"blake2b": blake2b_hash, "sha256": sha256_hash, "builtin": builtin_hash}


class KVBlock:
    __slots__ = ("block_id", "ref_count", "key", "parent", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: BlockKey | None = None  # prefix key of a full, cached block
        self.parent: object = None  # the key of the block before it (or the salt): compared on every hit
        self.token_ids: tuple[int, ...] | None = None  # its tokens, compared on every hit
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.head = KVBlock(-1)  # sentinels
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block


class BlockPool:
    """All blocks, the free queue and the key -> cached block map. `on_evict`, when set, sees each
    cached block just before allocation takes its content away (a KV-cache tier keeps it)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue, evicting their cached content."""
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            if block.key is not None and self.on_evict is not None:
                self.on_evict(block)
            self.uncache(block)
            block.ref_count = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a new request reuses (out of the free queue if idle)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def uncache(self, block: KVBlock) -> None:
        if block.key is not None and self.cached.get(block.key) is block:
            del self.cached[block.key]
        block.key = block.parent = block.token_ids = None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = blake2b_hash,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock | None]] = {}  # None: out of the window, returned
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as plain ints, for the runner
        self.req_keys: dict[str, list[BlockKey]] = {}  # prefix keys of the request's full blocks so far
        self.num_cached_blocks: dict[str, int] = {}  # how many of its blocks are registered in the cache
        self.computing: dict[BlockKey, str] = {}  # prompt blocks a running request is filling: key -> its id
        self.req_computing: dict[str, list[BlockKey]] = {}  # the keys each request put there
        self.prefix_queries = 0  # prompt tokens looked up (counters for /metrics)
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, 0..1 (cached but idle blocks count as free)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_keys(self, request: Request) -> list[BlockKey]:
        """Prefix keys of every full block of the request's tokens, computed incrementally."""
        keys = self.req_keys.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(keys), request.num_tokens // bs):
            keys.append(self.hash_fn(self._parent(keys, i, request), request.token_slice(i * bs, (i + 1) * bs)))
        return keys

    def _parent(self, keys: list[BlockKey], i: int, request: Request) -> object:
        """What block i's key chains to: the key of block i - 1, or for the first block the salt; under
        a LoRA adapter (whose K/V differ from the base model's) a key of the salt and the adapter's load
        id as a negative token, which no block of real tokens has."""
        if i:
            return keys[i - 1]
        return self.hash_fn(request.cache_salt, (-request.lora_id,)) if request.lora_id else request.cache_salt

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached blocks holding a prefix of the request's tokens, and how many
        tokens they cover. The last token is always recomputed, to produce logits. A request that asked
        for prompt logprobs computes its whole prompt (cached blocks hold K/V, not logprobs)."""
        if not self.enable_prefix_caching or request.params.needs_every_prompt_position:
            return [], 0
        bs = self.block_size
        hits: list[KVBlock] = []
        keys = self._block_keys(request)
        for i, key in enumerate(keys[: (request.num_tokens - 1) // bs]):
            block = self.pool.cached.get(key)
            if (
                block is None
                or block.parent != self._parent(keys, i, request)
                or block.token_ids != tuple(request.token_slice(i * bs, (i + 1) * bs))
            ):
                break
            hits.append(block)
        return hits, len(hits) * bs

    def block_chain(self, request: Request, first: int, end: int) -> list[tuple[BlockKey, object, tuple[int, ...]]]:
        """Key, parent and tokens of the request's full blocks `first` .. `end - 1`: what a block from
        a tier must match to stand for them (as a pool hit must)."""
        keys, bs = self._block_keys(request), self.block_size
        return [
            (keys[i], self._parent(keys, i, request), tuple(request.token_slice(i * bs, (i + 1) * bs)))
            for i in range(first, min(end, len(keys)))
        ]

    def waits_for_prefix(self, request: Request, num_hit_tokens: int) -> bool:
        """Whether the block right after the request's prefix hits is being filled by another running
        request: then the request should wait a step or more and take those blocks from the cache, not
        compute the same prefix again (agent sessions that start together with one system prompt)."""
        if not self.computing or not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return False
        i = num_hit_tokens // self.block_size
        if i >= (request.num_tokens - 1) // self.block_size:  # nothing more it could take from the cache
            return False
        owner = self.computing.get(self._block_keys(request)[i])
        return owner is not None and owner != request.request_id

    def mark_computing(self, request: Request, num_hit_tokens: int) -> None:
        """Note the full blocks of an admitted request's tokens past its hits that nobody holds or fills yet:
        `waits_for_prefix` of the requests after it looks them up until they are cached or it lets go."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return
        mine = self.req_computing.setdefault(request.request_id, [])
        for key in self._block_keys(request)[num_hit_tokens // self.block_size :]:
            if key not in self.pool.cached and key not in self.computing:
                self.computing[key] = request.request_id
                mine.append(key)

    def _stop_computing(self, request_id: str, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if self.computing.get(key) == request_id:
                del self.computing[key]

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a new request's prefix-cache lookup (once, when it is admitted)."""
        if self.enable_prefix_caching and not request.params.needs_every_prompt_position:
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), num_lookahead_tokens: int = 0
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens (plus lookahead slots for
        speculative decoding), first adopting `computed_blocks` from the prefix cache. Returns False,
        changing nothing, when the pool is too small."""
        self.free_out_of_window(request)
        if not self.can_allocate(request, num_new_tokens, computed_blocks, num_lookahead_tokens):
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        ids = self.req_block_ids.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            ids.extend(b.block_id for b in computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        if need > 0:
            new = self.pool.allocate(need)
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
        return True

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), num_lookahead_tokens: int = 0
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed."""
        held = len(self.req_blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - held - len(computed_blocks)
        idle_hits = sum(1 for b in computed_blocks if b.ref_count == 0)  # reusing them takes them off the free queue
        return need + idle_hits <= self.pool.num_free

    def free_out_of_window(self, request: Request) -> None:
        """Return the blocks no query from the next position on can see (all before pos - window + 1)."""
        if self.sliding_window is None or request.request_id not in self.req_blocks:
            return
        blocks, ids = self.req_blocks[request.request_id], self.req_block_ids[request.request_id]
        dead = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        for i in range(min(dead, len(blocks))):
            if blocks[i] is None:
                continue
            self.pool.release([blocks[i]])
            blocks[i], ids[i] = None, 0

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (out-of-window ones returned)."""
        return sum(b is not None for b in self.req_blocks.get(request_id, ()))

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens this step."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = request.num_computed_tokens // self.block_size
        if end <= start:
            return
        keys = self._block_keys(request)
        blocks = self.req_blocks[rid]
        bs = self.block_size
        for i in range(start, end):
            block = blocks[i]
            if block is not None and block.key is None and keys[i] not in self.pool.cached:
                block.key, block.parent = keys[i], self._parent(keys, i, request)
                block.token_ids = tuple(request.token_slice(i * bs, (i + 1) * bs))
                self.pool.cached[block.key] = block
        if self.computing:
            self._stop_computing(rid, keys[start:end])
        self.num_cached_blocks[rid] = end

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_block_ids[request_id]

    def free(self, request: Request) -> None:
        """Return a request's blocks, last block first, so a sequence's tail is evicted before its
        (more shareable) head."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._stop_computing(rid, self.req_computing.pop(rid, ()))
        if request.status.finished:
            self.req_keys.pop(rid, None)
        self.pool.release(b for b in reversed(blocks) if b is not None)

    def reset_prefix_cache(self) -> int:
        """Forget all cached content (blocks in use stay with their requests). Returns how many
        blocks were dropped from the cache."""
        dropped = len(self.pool.cached)
        for block in list(self.pool.cached.values()):
            self.pool.uncache(block)
        return dropped
