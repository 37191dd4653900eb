"""Cost of the prefix-cache block key per hash function (no model): keys for every full block of
prompts of --prompt-len tokens, then the lookup of an identical prompt (all hits, so every block's
tokens and parent are compared too).

    .venv/bin/python benchmarks/bench_prefix_hash.py [--prompt-len 1024] [--prompts 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill.engine.kv_cache_manager import HASH_FUNCTIONS, KVCacheManager
from tokenmill.engine.request import EngineCoreRequest, Request
from tokenmill.sampling_params import SamplingParams


def run(hash_name: str, prompts: list[list[int]], block_size: int) -> tuple[float, float]:
    kv = KVCacheManager(
        num_blocks=len(prompts[0]) // block_size + 2, block_size=block_size, hash_fn=HASH_FUNCTIONS[hash_name]
    )
    params = SamplingParams(max_tokens=1)
    register, lookup = [], []
    for i, prompt in enumerate(prompts):
        first = Request(EngineCoreRequest(f"a{i}", prompt, params), params, set())
        start = time.perf_counter()
        kv.allocate_slots(first, len(prompt))
        first.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(first)  # computes and registers every block key
        register.append(time.perf_counter() - start)
        kv.free(first)
        again = Request(EngineCoreRequest(f"b{i}", prompt, params), params, set())
        start = time.perf_counter()
        blocks, hit = kv.get_computed_blocks(again)
        lookup.append(time.perf_counter() - start)
        assert hit == (len(prompt) - 1) // block_size * block_size
    return statistics.median(register) * 1e6, statistics.median(lookup) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens per random prompt (default: %(default)s)")
    ap.add_argument(
        "--prompts", type=int, default=200, help="prompts keyed and looked up per hash function (default: %(default)s)"
    )
    ap.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block: one key per full block (default: %(default)s)"
    )
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    blocks = args.prompt_len // args.block_size
    print(f"# {args.prompts} prompts of {args.prompt_len} tokens ({blocks} blocks of {args.block_size}); medians")
    print(f"{'hash':<8} {'register us':>12} {'lookup us':>10} {'us per block':>13}")
    for name in HASH_FUNCTIONS:
        reg, look = run(name, prompts, args.block_size)
        print(f"{name:<8} {reg:>12.1f} {look:>10.1f} {(reg + look) / blocks:>13.2f}")


if __name__ == "__main__":
    main()
