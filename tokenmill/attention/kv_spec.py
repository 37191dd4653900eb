"""KV-cache specs: what each attention layer stores per token, and how the paged cache is sized
from them.

Every `Attention` layer declares an `AttentionSpec` (kv heads, head dim, cache dtype, sliding window
or full). Layers with equal specs form a group with one cache tensor; the block pool is shared by
all groups (a request's block table addresses the same block ids in every layer), so a block costs
the sum of its layers' bytes. Layers of another shape or dtype become further groups. Multi-head latent
attention (DeepSeek's MLA) declares an `MLAAttentionSpec`: one compressed latent per token (plus its
rotary part) serves as the key of every head and, in its first `kv_lora_rank` features, the value.
An int8 / fp8 cache (`tokenmill.attention.kv_quant`) also stores a scale per K and V row: its bytes per
token count them, so the pool holds as many blocks as fit with their scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.kv_quant import SCALE_DTYPE, is_quantized
from tokenmill.config import CacheConfig


@dataclass(frozen=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the stored K/V (may differ from the compute dtype)
    sliding_window: int | None = None  # None: attends to every earlier token
    num_tensors = 2  # a K and a V row per token (and kv head)

    @property
    def bytes_per_token(self) -> int:
        row = self.head_dim * self.dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(self.dtype) else 0)
        return self.num_tensors * self.num_kv_heads * row


@dataclass(frozen=True)
class MLAAttentionSpec(AttentionSpec):
    """One row per token: the latent (`head_dim - rope_dim` features, also the value) and the rotated
    key part shared by all heads (`rope_dim`); `num_kv_heads` is 1."""

    rope_dim: int = 0
    num_tensors = 1

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim - self.rope_dim


@dataclass
class KVCacheGroup:
    spec: AttentionSpec
    layer_names: list[str]
    pool: int = 0  # which block pool (and block table) its layers use


@dataclass
class KVCacheConfig:
    """The block pools and the groups of layers on them. Layers of one sliding window (or all with
    none) share a pool; a model that mixes windowed and full layers (Gemma) gets a pool per window, so
    a window pool's blocks can return as they leave the window while the full pool keeps every block.
    Pool 0 holds the full-attention layers (when there are any): its size bounds a sequence's length.
    With context parallelism over `context_parallel` ranks a block's tokens are striped over them
    (`tokenmill.attention.context_parallel`): the bytes here are one rank's, block_size / N tokens a block."""

    pool_blocks: list[int]
    block_size: int
    groups: list[KVCacheGroup]
    context_parallel: int = 1

    @property
    def num_blocks(self) -> int:
        return self.pool_blocks[0]

    @property
    def pool_windows(self) -> list[int | None]:
        return [next(g.spec.sliding_window for g in self.groups if g.pool == p) for p in range(len(self.pool_blocks))]

    def pool_bytes_per_block(self, pool: int) -> int:
        tokens = self.block_size // self.context_parallel  # stored on this rank
        return tokens * sum(g.spec.bytes_per_token * len(g.layer_names) for g in self.groups if g.pool == pool)

    @property
    def bytes_per_token(self) -> int:
        """One rank's bytes per token of a sequence (with context parallelism: 1/N of a token's K/V)."""
        return sum(g.spec.bytes_per_token * len(g.layer_names) for g in self.groups) // self.context_parallel

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        return sum(n * self.pool_bytes_per_block(p) for p, n in enumerate(self.pool_blocks))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def longest_context(self, model_max_len: int, max_num_batched_tokens: int) -> int:
        """The largest context (up to `model_max_len`) for which one sequence's blocks fit these pools:
        pool 0's tokens when any layer attends to the full context, the model's own length when every
        layer is windowed and one sequence's window fits (`serve --max-model-len auto`)."""
        window = self.pool_windows[0]
        if window is not None and self.num_blocks >= window_pool_blocks(
            window, self.block_size, 1, max_num_batched_tokens
        ):
            return model_max_len  # every layer windowed, and one sequence's window fits: any length does
        return min(model_max_len, self.capacity_tokens)

    @property
    def tokens_per_gib(self) -> int:
        """Tokens of every layer's K/V that fit in 1 GiB."""
        return 2**30 // self.bytes_per_token


def group_specs(specs: dict[str, AttentionSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs, in layer order of their first member; pools by sliding window, full first."""
    groups: dict[AttentionSpec, KVCacheGroup] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, KVCacheGroup(spec, [])).layer_names.append(name)
    windows = sorted({g.spec.sliding_window for g in groups.values()}, key=lambda w: (w is not None, w or 0))
    for group in groups.values():
        group.pool = windows.index(group.spec.sliding_window)
    return list(groups.values())


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window pool can ever need: each running sequence's window plus a partial block at
    each end, and the step's new tokens."""
    return max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def make_kv_cache_config(
    specs: dict[str, AttentionSpec],
    cache: CacheConfig,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    context_parallel: int = 1,
) -> KVCacheConfig:
    """Size the pools: `cache.num_blocks` blocks (window pools: no more than they can use), or as many
    as fit in `cache.kv_cache_memory_gib` (window pools capped the same way, the rest to pool 0) on each
    rank (`context_parallel` ranks: each stores 1/N of a block)."""
    config = KVCacheConfig([0], cache.block_size, group_specs(specs), context_parallel)
    config.pool_blocks = [0] * (1 + max(g.pool for g in config.groups))
    windows = config.pool_windows
    caps = [
        None
        if w is None or len(windows) == 1
        else window_pool_blocks(w, cache.block_size, max_num_seqs, max_num_batched_tokens)
        for w in windows
    ]
    if cache.num_blocks is not None:
        config.pool_blocks = [cache.num_blocks if c is None else min(cache.num_blocks, c) for c in caps]
        return config
    budget = int(cache.kv_cache_memory_gib * 2**30)
    capped = sum(c * config.pool_bytes_per_block(p) for p, c in enumerate(caps) if c is not None)
    rest = sum(config.pool_bytes_per_block(p) for p, c in enumerate(caps) if c is None)
    full = (budget - capped) // rest if rest else 0
    if full < max((c for c in caps if c is not None), default=0):  # too small to cap: split evenly
        full = budget // config.bytes_per_block
        caps = [None] * len(caps)
    config.pool_blocks = [full if c is None else c for c in caps]
    if min(config.pool_blocks) < 1:
        raise ValueError(
            f"kv_cache_memory {cache.kv_cache_memory_gib} GiB is smaller than one KV block "
            f"({config.bytes_per_block} bytes)"
        )
    return config
