"""What the engine can hold: the longest context for which one sequence fits the KV cache, sized as the
engine sizes it (`make_kv_cache_config`); the engine resolves `serve --max-model-len auto` with the same
`KVCacheConfig.longest_context`."""

from __future__ import annotations

from tokenmill.attention.kv_spec import AttentionSpec, make_kv_cache_config
from tokenmill.config import CacheConfig


def max_model_len_that_fits(
    specs: dict[str, AttentionSpec],
    cache: CacheConfig,
    model_max_len: int,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
) -> int:
    """The largest context (up to `model_max_len`) for which one sequence's blocks fit the pools the
    engine would allocate. Raises ValueError, naming the sizes, when not even one block fits."""
    config = make_kv_cache_config(specs, cache, max_num_seqs, max_num_batched_tokens)
    return config.longest_context(model_max_len, max_num_batched_tokens)
