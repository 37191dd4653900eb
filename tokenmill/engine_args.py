"""Command-line flags that build an `EngineConfig`, shared by `generate`, `serve` and `bench offline`."""

from __future__ import annotations

import argparse

from tokenmill.config import (KV_CACHE_DTYPES, PREFIX_CACHE_HASHES, CacheConfig, EngineConfig, ParallelConfig,
                              SchedulerConfig, SpeculativeConfig)
from tokenmill.loader.source import DEFAULT_MODEL
from tokenmill.quantization import QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    cache, sched = CacheConfig(), SchedulerConfig()
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model to load: an alias ({DEFAULT_MODEL}), a .gguf file, or an HF checkpoint directory "
                        "with config.json and *.safetensors; never downloaded (default: %(default)s)")
    m.add_argument("--dtype", default="auto",
                   help="compute dtype: auto (float32 on CPU, the checkpoint's 16-bit type on CUDA), float32, "
                        "bfloat16 or float16; an explicit float32 also picks the exact GGUF mode (see "
                        "--quantization) (default: %(default)s)")
    m.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default: %(default)s)")
    m.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="auto",
                   help="weight format: gguf = keep a GGUF file's quantized blocks (Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/"
                        "Q4_K/Q5_K/Q6_K) packed and dequantize inside the matmul (CPU, float32; exactly the file's "
                        "weights, 3-7x fewer bytes per decode step); gguf-q8 = the same with decode activations "
                        "rounded to int8 per 32 values and integer dot products, as llama.cpp (faster decode; not "
                        "exact, and outputs can change with batching and prefix hits); none = dense weights; "
                        "int8 / int4 = quantize a dense HF checkpoint on load (int8 per output row, int4 per "
                        "group, see --quantization-group-size); awq / gptq = an AutoAWQ / AutoGPTQ checkpoint "
                        "(read from its quantization_config); fp8 = float8 e4m3 weights (a dense checkpoint "
                        "quantized on load per output row, or an fp8 checkpoint's own blocks; CPU float32 or CUDA); "
                        "mxfp4 / nvfp4 = quantize a dense HF checkpoint on load to FP4 (e2m1 with a power-of-two "
                        "scale per 32 / an e4m3 scale per 16 values), run like int8; compressed-tensors = an "
                        "llm-compressor checkpoint (fp8, int4/int8, NVFP4, MXFP4 per config group); "
                        "the integer methods run like gguf-q8, or with float32 "
                        "activations (exactly the quantized weights) when --dtype float32 is given; auto = the "
                        "checkpoint's own format: for a GGUF file on CPU gguf-q8 (gguf with --dtype float32), "
                        "awq/gptq/fp8/compressed-tensors for such checkpoints, else none (default: %(default)s)")
    m.add_argument("--quantization-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="int8 / int4: input columns sharing one scale (default: int4 32, int8 one per output row)")
    m.add_argument("--quantization-symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="int8 / int4: codes symmetric around zero (one scale per group) or asymmetric (a scale and "
                        "a minimum per group, a closer fit for skewed groups) (default: int8 symmetric, int4 "
                        "asymmetric)")
    m.add_argument("--seed", type=int, default=0,
                   help="global random seed; a request's own 'seed' overrides it (default: %(default)s)")
    m.add_argument("--max-model-len", type=int, default=sched.max_model_len,
                   help="longest prompt + output in tokens (default: the model's context length)")
    c = parser.add_argument_group("KV cache and scheduling")
    c.add_argument("--kv-cache-memory", type=float, default=cache.kv_cache_memory_gib, metavar="GIB",
                   help="memory for the paged KV cache in GiB; sets the number of blocks (default: %(default)s)")
    c.add_argument("--num-kv-blocks", type=int, default=cache.num_blocks,
                   help="exact number of KV cache blocks (overrides --kv-cache-memory)")
    c.add_argument("--kv-cache-dtype", default=cache.cache_dtype, choices=KV_CACHE_DTYPES, metavar="DTYPE",
                   help="dtype the KV cache stores keys and values in: auto (float16 with the default gguf-q8 "
                        "weights, else the compute dtype), float32, bfloat16 or float16; a 16-bit cache under "
                        "float32 compute halves the bytes per token. int8, fp8_e4m3 (alias fp8) and fp8_e5m2 store "
                        "one byte per value plus a scale per token and kv head (about 1.9x the tokens of a 16-bit "
                        "cache at a little accuracy; an MLA latent cache: one scale per token) (default: %(default)s)")
    c.add_argument("--block-size", type=int, default=cache.block_size,
                   help="tokens per KV cache block (default: %(default)s)")
    c.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs,
                   help="most sequences running in one step (default: %(default)s)")
    c.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=cache.enable_prefix_caching,
                   help="reuse the KV blocks of identical prompt prefixes across requests (default: on)")
    c.add_argument("--prefix-cache-hash", choices=PREFIX_CACHE_HASHES, default=cache.prefix_cache_hash,
                   help="hash for prefix-cache block keys: blake2b = keyed with a random per-process key "
                        "(collision-resistant, unpredictable), sha256 = the same keys in every process, builtin = "
                        "Python's hash (fastest, 64-bit); a hit always checks the block's tokens and parent too "
                        "(default: %(default)s)")
    c.add_argument("--grammar-timeout", type=float, default=30.0,
                   help="seconds a structured-output grammar (JSON schema, regex, EBNF) may take to compile, in "
                        "a worker process that is killed when it runs over; the request is then rejected "
                        "(HTTP 400) (default: %(default)s)")
    c.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: a JSON object with method (ngram: draft the tokens "
                        "that followed the latest earlier match of the last n tokens; medusa: heads on the target's "
                        "last hidden state, from the checkpoint directory in \"model\", e.g. one written by "
                        "tokenmill train-draft-head; draft_model: a smaller model with the same tokenizer, named in \"model\", "
                        "drafting on a KV cache of its own; eagle3: an EAGLE-3 drafter checkpoint in \"model\" "
                        "(published layout, or one written by tokenmill train-draft-head --kind eagle3) fed three of "
                        "the target's layers' hidden states; mtp / deepseek_mtp: the MTP layer of a DeepSeek-V3-style "
                        "target's own checkpoint), num_speculative_tokens "
                        "(default 4), prompt_lookup_min / prompt_lookup_max (n, default 2 / 4) and "
                        "disable_by_batch_size (draft nothing while more requests run, default 4) and max_verify_tokens "
                        "(decodes + drafts in one step, default 16: two of the CPU int8 kernel's 8-row tiles); the output "
                        "distribution is unchanged (greedy: the same tokens), also with penalties, logit_bias, min_tokens, "
                        "logprobs and structured output (drafts cut where the grammar rejects them, each verified "
                        "position masked); requests with \"speculative\": false, and constrained ones while "
                        "thinking, decode without it. Default: off")
    c.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split every layer over N processes on this host (attention heads, MLP columns and the "
                        "vocabulary; one all-reduce after attention and one after the MLP), joined by "
                        "torch.distributed: gloo on CPU (each rank bound to its share of the cores), NCCL on CUDA "
                        "(one GPU per rank); MoE experts split by their intermediate features, MLA by heads "
                        "(default: %(default)s)")
    c.add_argument("--enable-expert-parallel", action="store_true",
                   help="as vLLM's flag: place whole MoE experts across the --tensor-parallel-size ranks "
                        "(expert e on rank e // (experts / N)) instead of splitting every expert; tokens travel "
                        "to their experts' ranks and back by all-to-all, attention stays tensor-parallel. "
                        "Needs an MoE model whose expert count divides by N (default: off)")
    c.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="split the decoder layers into N consecutive stages, each in its own process(es) (times "
                        "--tensor-parallel-size); the hidden state passes between stages point to point over "
                        "torch.distributed and up to N steps are in flight at once (default: %(default)s)")
    c.add_argument("--pipeline-layer-partition", default=None, metavar="A,B,...",
                   help="decoder layers per pipeline stage, e.g. 10,12 (must sum to the model's layers; "
                        "default: an even split, which needs the layers to divide by --pipeline-parallel-size)")
    c.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how the workers of a tensor- or pipeline-parallel engine start: mp (processes spawned "
                        "here) or ray (Ray actors in a placement group of a local Ray cluster on 127.0.0.1, "
                        "started if none runs in this process; needs the ray package) (default: %(default)s)")
    c.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=sched.policy,
                   help="order of waiting requests: arrival (fcfs), or the request's 'priority' field, lower "
                        "first (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, quantization=args.quantization,
        quantization_group_size=args.quantization_group_size, quantization_symmetric=args.quantization_symmetric,
        grammar_timeout=args.grammar_timeout,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          num_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                          prefix_cache_hash=args.prefix_cache_hash, cache_dtype=args.kv_cache_dtype),
        speculative=SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                pipeline_layer_partition=_layer_partition(args.pipeline_layer_partition),
                                distributed_executor_backend=args.distributed_executor_backend,
                                enable_expert_parallel=args.enable_expert_parallel),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, policy=args.scheduling_policy),
    )


def _layer_partition(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--pipeline-layer-partition must be comma-separated layer counts, got {text!r}") from None
