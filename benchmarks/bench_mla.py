"""Multi-head latent attention: KV bytes per token and decode speed at growing context, tokenmill
(absorbed attention over the latent cache) vs transformers (which caches the latent too but expands
it through kv_b_proj for every head at every step), same weights, same run.

    .venv/bin/python benchmarks/bench_mla.py [--contexts 256,1024,2048] [--tokens 32] [--layers 2]

The model is random-weight with DeepSeek-V2-Lite's attention shapes (16 heads, kv_lora_rank 512,
rope 64, nope 128, v 128, hidden 2048) and a dense MLP, `--layers` deep: the attention is real size,
the rest small enough for this machine. No real DeepSeek checkpoint fits here (V2-Lite: 16B).
Decode: tokens/s after the first, single stream, medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time

import torch
import transformers
from bench_decode import hf_generate_speeds  # this script's neighbour (benchmarks/ is on sys.path)

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import UniProcExecutor
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

V2_LITE_ATTENTION = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)


def tokenmill_decode(directory: str, prompt: list[int], n: int) -> float:
    blocks = (len(prompt) + n) // 16 + 4
    config = EngineConfig(
        model=directory,
        cache=CacheConfig(num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=len(prompt) + n + 16),
    )
    core = EngineCore(config, UniProcExecutor(config, load_model(directory)), set())
    core.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    times = []
    while core.has_unfinished():
        if any(o.new_token_ids for o in core.step()):
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--contexts",
        default="256,1024,2048",
        help="prompt lengths in tokens to decode after, comma-separated: one row each (default: %(default)s)",
    )
    ap.add_argument("--tokens", type=int, default=32, help="tokens to decode per run (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random model (default: %(default)s)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per engine and context, median reported (default: %(default)s)",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(
        vocab_size=1024,
        intermediate_size=1408,
        num_hidden_layers=args.layers,
        first_k_dense_replace=args.layers,
        max_position_embeddings=8192,
        **V2_LITE_ATTENTION,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tempfile.mkdtemp(prefix="bench-mla-")
    hf.save_pretrained(directory)
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    full = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * 4
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; DeepSeek-V2-Lite attention, {args.layers} layers; decode {args.tokens}; medians of {args.repeats}"
    )
    print(
        f"# KV bytes per token and layer (float32): latent {latent}, full per-head K/V {full} "
        f"({full / latent:.1f}x); tokens per GiB of KV per layer: {2**30 // latent} vs {2**30 // full}"
    )
    print(f"{'context':>8} {'tokenmill decode tok/s':>23} {'transformers':>13} {'ratio':>7}")
    for context in (int(c) for c in args.contexts.split(",")):
        rng = random.Random(context)
        prompt = [rng.randrange(config.vocab_size) for _ in range(context)]
        ours = statistics.median(tokenmill_decode(directory, prompt, args.tokens) for _ in range(args.repeats))
        theirs = statistics.median(hf_generate_speeds(hf, prompt, args.tokens)[1] for _ in range(args.repeats))
        print(f"{context:>8} {ours:>23.1f} {theirs:>13.1f} {ours / theirs:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
