"""`KVCacheCoordinator`: the scheduler's one view of the KV cache, over one `KVCacheManager` per block
pool (`attention/kv_spec.py`: a pool per sliding window; pool 0 holds the full-attention layers).

A request has a block table in every pool. Room is given in all pools or in none; a prefix-cache
hit counts only as far as every pool has it; the counts the server reports (blocks, free blocks,
prefix-cache lookups) are the pools' together. Most models have one pool, and then this is a thin
wrapper around its manager.
"""

from __future__ import annotations

from tokenmill.engine.kv_cache_manager import KVBlock, KVCacheManager
from tokenmill.engine.request import Request


class KVCacheCoordinator:
    def __init__(self, managers: list[KVCacheManager]) -> None:
        self.managers = managers
        self.block_size = managers[0].block_size

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the cache can hold (pool 0's size: its layers keep every block)."""
        return self.managers[0].num_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        """The fullest pool's usage: the one that stops the next allocation."""
        return max(m.usage for m in self.managers)

    @property
    def prefix_queries(self) -> int:
        return self.managers[0].prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.managers[0].prefix_hits

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each pool."""
        return [m.block_ids(request_id) for m in self.managers]

    def holds_block(self, request_id: str, index: int) -> bool:
        """Whether every pool still holds the request's block `index` (a sliding window's pool returns
        the blocks that fall out of its window)."""
        return all(m.req_blocks[request_id][index] is not None for m in self.managers)

    def num_live_blocks(self, request_id: str) -> list[int]:
        return [m.num_live_blocks(request_id) for m in self.managers]

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per pool the cached blocks of the request's longest prefix that every pool holds, and its
        length in tokens."""
        found = [m.get_computed_blocks(request) for m in self.managers]
        num_tokens = min(n for _, n in found)
        return [blocks[: num_tokens // self.block_size] for blocks, _ in found], num_tokens

    def waits_for_prefix(self, request: Request, num_hit_tokens: int) -> bool:
        """Pool 0 (full attention: every block kept) tells whether another request is filling its prefix."""
        return self.managers[0].waits_for_prefix(request, num_hit_tokens)

    def mark_computing(self, request: Request, num_hit_tokens: int) -> None:
        self.managers[0].mark_computing(request, num_hit_tokens)

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.managers[0].record_lookup(request, num_hit_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[list[KVBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Room for `num_new_tokens` more tokens in every pool, or (changing nothing but returning
        blocks already out of a window) False."""
        computed = computed_blocks or [[] for _ in self.managers]
        for m in self.managers:
            m.free_out_of_window(request)
        if not all(
            m.can_allocate(request, num_new_tokens, c, num_lookahead_tokens) for m, c in zip(self.managers, computed)
        ):
            return False
        for m, c in zip(self.managers, computed):
            m.allocate_slots(request, num_new_tokens, c, num_lookahead_tokens)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        for m in self.managers:
            m.cache_full_blocks(request)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    def reset_prefix_cache(self) -> int:
        return sum(m.reset_prefix_cache() for m in self.managers)
