"""KV-cache specs: what each attention layer stores per token, and how the paged cache is sized
from them.

Every `Attention` layer declares an `AttentionSpec` (kv heads, head dim, cache dtype, sliding window
or full). Layers with equal specs form a group with one cache tensor; the block pool is shared by
all groups (a request's block table addresses the same block ids in every layer), so a block costs
the sum of its layers' bytes. Today's models have one group; layers of another shape or dtype (a
latent KV, a different cache dtype) become further groups without changing the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import CacheConfig


@dataclass(frozen=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the stored K/V (may differ from the compute dtype)
    sliding_window: int | None = None  # None: attends to every earlier token

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass
class KVCacheGroup:
    spec: AttentionSpec
    layer_names: list[str]


@dataclass
class KVCacheConfig:
    num_blocks: int
    block_size: int
    groups: list[KVCacheGroup]

    @property
    def bytes_per_token(self) -> int:
        return sum(g.spec.bytes_per_token * len(g.layer_names) for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def group_specs(specs: dict[str, AttentionSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs, in layer order of their first member."""
    groups: dict[AttentionSpec, KVCacheGroup] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, KVCacheGroup(spec, [])).layer_names.append(name)
    return list(groups.values())


def make_kv_cache_config(specs: dict[str, AttentionSpec], cache: CacheConfig) -> KVCacheConfig:
    """Size the pool: `cache.num_blocks` blocks, or as many as fit in `cache.kv_cache_memory_gib`."""
    config = KVCacheConfig(0, cache.block_size, group_specs(specs))
    if cache.num_blocks is not None:
        config.num_blocks = cache.num_blocks
    else:
        config.num_blocks = int(cache.kv_cache_memory_gib * 2**30) // config.bytes_per_block
        if config.num_blocks < 1:
            raise ValueError(f"kv_cache_memory {cache.kv_cache_memory_gib} GiB is smaller than one KV block "
                             f"({config.bytes_per_block} bytes)")
    return config
