"""KV cache manager: a pool of fixed-size blocks, per-request block tables and reference counts.

The pool is created once; blocks never move. Free blocks wait in a doubly linked queue (O(1) pop
from the front, append at the back, removal from the middle) so that a later prefix cache can keep
freed blocks' content and evict the least recently freed first.
"""

from __future__ import annotations

from tokenmill.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # content key of a full block (set by the prefix cache)
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
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            block.ref_count = 1
            block.block_hash = None
        return blocks

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as plain ints, for the runner

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Blocks already holding a prefix of the request's tokens, and how many tokens they cover.
        Prefix caching hooks in here; without it nothing is ever reused."""
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more tokens (plus lookahead slots
        for speculative decoding). Returns False, changing nothing, when the pool is too small."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        ids = self.req_block_ids.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        new = self.pool.allocate(need)
        blocks.extend(new)
        ids.extend(b.block_id for b in new)
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_block_ids[request_id]

    def free(self, request: Request) -> None:
        """Return a request's blocks, last block first, so the tail of a sequence is reused first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.pool.release(reversed(blocks))
