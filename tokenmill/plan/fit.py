"""What the engine can hold: the longest context for which one sequence fits the KV cache, sized as the
engine sizes it (`make_kv_cache_config`), for `serve --max-model-len auto`."""

from __future__ import annotations

from tokenmill.attention.kv_spec import (
    AttentionSpec,
    make_kv_cache_config,
    window_pool_blocks,
)
from tokenmill.config import CacheConfig


def max_model_len_that_fits(
    specs: dict[str, AttentionSpec],
    cache: CacheConfig,
    model_max_len: int,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
) -> int:
    """The largest context (up to `model_max_len`) for which one sequence's blocks fit the pools the
    engine would allocate: pool 0's tokens when any layer attends to the full context (window pools
    are capped at what their windows can use), the model's own length when every layer is windowed and
    one window fits.
    Raises ValueError, naming the sizes, when not even one block fits."""
    config = make_kv_cache_config(specs, cache, max_num_seqs, max_num_batched_tokens)
    window = config.pool_windows[0]
    if window is not None and config.num_blocks >= window_pool_blocks(
        window, cache.block_size, 1, max_num_batched_tokens
    ):
        return model_max_len  # every layer windowed, and one sequence's window fits: any length does
    return min(model_max_len, config.capacity_tokens)
