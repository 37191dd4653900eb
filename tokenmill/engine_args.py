"""`EngineArgs`: the engine's settings as one flat set of fields, shared by every way of starting an
engine: the flags of `serve`, `generate`, `bench offline` and `eval` (`add_engine_args` / `EngineArgs.from_cli_args`),
`LLM(**kwargs)` and the draft-head trainers. `create_engine_config()` builds the `EngineConfig` tree
(`tokenmill.config`), whose dataclasses validate every value, so a flag and a keyword are checked by
the same code and say the same thing when wrong.

This module imports neither torch nor the engine (the config tree is imported when a config is built,
the names of weight formats and cache dtypes when argparse first checks or prints them), so every
command's parser is built without them: `tokenmill router --help` does not load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, SpeculativeConfig
    from tokenmill.kv_transfer.config import KVTransferConfig

# the same name as tokenmill.loader.source.DEFAULT_MODEL (a test checks it): importing that package loads torch
DEFAULT_MODEL = "smollm2-135m-instruct"


class _LazyNames:
    """A tuple of names read from a module that imports torch when argparse first checks a value
    against it or prints an error, not when the parser is built (an argument with these choices needs
    a metavar: argparse formats the choices of one without it as it adds it)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def _names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __iter__(self):
        return iter(self._names())


QUANTIZATION_CHOICES = _LazyNames("tokenmill.quantization", "QUANTIZATION_METHODS")
KV_CACHE_DTYPE_CHOICES = _LazyNames("tokenmill.config", "KV_CACHE_DTYPES")
PREFIX_CACHE_HASH_CHOICES = _LazyNames("tokenmill.config", "PREFIX_CACHE_HASHES")


@dataclass
class EngineArgs:
    """Every engine setting, by the name of its flag (`--kv-cache-memory` is `kv_cache_memory`). The
    defaults are those of the `EngineConfig` tree (a test checks that `EngineArgs(model=None)` builds
    `EngineConfig()`); `speculative_config` and `kv_transfer_config` take a config, a dict of its
    fields or its JSON text."""

    model: str | None = DEFAULT_MODEL  # an alias, a .gguf file or an HF directory (None: the default model)
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    quantization: str = "auto"
    quantization_group_size: int | None = None
    quantization_symmetric: bool | None = None
    max_model_len: int | None = None
    kv_cache_memory: float = 1.0  # GiB
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "blake2b"
    grammar_timeout: float = 30.0
    speculative_config: SpeculativeConfig | dict | str | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] | str = ()  # layers per stage, or "A,B,..."
    distributed_executor_backend: str = "mp"
    decode_context_parallel_size: int = 1  # not built: only 1 (ParallelConfig refuses more)
    prefill_context_parallel_size: int = 1
    scheduling_policy: str = "fcfs"
    kv_transfer_config: KVTransferConfig | dict | str | None = None  # disaggregated prefill/decode; None: off

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, caller: str, **kwargs: Any) -> EngineArgs:
        """From keywords (`LLM(**kwargs)`): a name that is not a setting is a TypeError naming it."""
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"{caller} got unknown engine argument(s) {', '.join(unknown)}; the engine arguments "
                f"are {', '.join(cls.names())}"
            )
        return cls(**kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """From the flags `add_engine_args` added; `--kv-role` with `--kv-transfer-config` where the command has them."""
        values = {name: getattr(args, name) for name in cls.names() if hasattr(args, name)}
        if hasattr(args, "kv_role"):
            from tokenmill.kv_transfer.config import KVTransferConfig

            values["kv_transfer_config"] = KVTransferConfig.from_args(args.kv_role, args.kv_transfer_config)
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        """The validated configuration tree (ValueError naming the setting at fault)."""
        from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            quantization_symmetric=self.quantization_symmetric,
            grammar_timeout=self.grammar_timeout,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_gib=self.kv_cache_memory,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_cache_hash=self.prefix_cache_hash,
                cache_dtype=self.kv_cache_dtype,
            ),
            speculative=_speculative(self.speculative_config),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                pipeline_layer_partition=_layer_partition(self.pipeline_layer_partition),
                distributed_executor_backend=self.distributed_executor_backend,
                enable_expert_parallel=self.enable_expert_parallel,
                decode_context_parallel_size=self.decode_context_parallel_size,
                prefill_context_parallel_size=self.prefill_context_parallel_size,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=self.scheduling_policy,
            ),
            kv_transfer=_kv_transfer(self.kv_transfer_config),
        )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags of every field but `kv_transfer_config` (`serve`'s `--kv-role` / `--kv-transfer-config`)."""
    d = EngineArgs()
    m = parser.add_argument_group("model")
    m.add_argument(
        "--model",
        default=d.model,
        help=f"model to load: an alias ({DEFAULT_MODEL}), a .gguf file, or an HF checkpoint directory "
        "with config.json and *.safetensors; never downloaded (default: %(default)s)",
    )
    m.add_argument(
        "--dtype",
        default=d.dtype,
        help="compute dtype: auto (float32 on CPU, the checkpoint's 16-bit type on CUDA), float32, "
        "bfloat16 or float16; an explicit float32 also picks the exact GGUF mode (see "
        "--quantization) (default: %(default)s)",
    )
    m.add_argument("--device", default=d.device, help="torch device: cpu, cuda or cuda:N (default: %(default)s)")
    m.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        metavar="METHOD",
        default=d.quantization,
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
        "awq/gptq/fp8/compressed-tensors for such checkpoints, else none (default: %(default)s)",
    )
    m.add_argument(
        "--quantization-group-size",
        type=int,
        choices=(32, 64, 128),
        default=None,
        help="int8 / int4: input columns sharing one scale (default: int4 32, int8 one per output row)",
    )
    m.add_argument(
        "--quantization-symmetric",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int8 / int4: codes symmetric around zero (one scale per group) or asymmetric (a scale and "
        "a minimum per group, a closer fit for skewed groups) (default: int8 symmetric, int4 "
        "asymmetric)",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="global random seed; a request's own 'seed' overrides it (default: %(default)s)",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context length)",
    )
    c = parser.add_argument_group("KV cache and scheduling")
    c.add_argument(
        "--kv-cache-memory",
        type=float,
        default=d.kv_cache_memory,
        metavar="GIB",
        help="memory for the paged KV cache in GiB; sets the number of blocks (default: %(default)s)",
    )
    c.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks (overrides --kv-cache-memory)"
    )
    c.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPE_CHOICES,
        metavar="DTYPE",
        help="dtype the KV cache stores keys and values in: auto (float16 with the default gguf-q8 "
        "weights, else the compute dtype), float32, bfloat16 or float16; a 16-bit cache under "
        "float32 compute halves the bytes per token. int8, fp8_e4m3 (alias fp8) and fp8_e5m2 store "
        "one byte per value plus a scale per token and kv head (about 1.9x the tokens of a 16-bit "
        "cache at a little accuracy; an MLA latent cache: one scale per token) (default: %(default)s)",
    )
    c.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per KV cache block (default: %(default)s)"
    )
    c.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most sequences running in one step (default: %(default)s)",
    )
    c.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV blocks of identical prompt prefixes across requests (default: on)",
    )
    c.add_argument(
        "--prefix-cache-hash",
        choices=PREFIX_CACHE_HASH_CHOICES,
        metavar="HASH",
        default=d.prefix_cache_hash,
        help="hash for prefix-cache block keys: blake2b = keyed with a random per-process key "
        "(collision-resistant, unpredictable), sha256 = the same keys in every process, builtin = "
        "Python's hash (fastest, 64-bit); a hit always checks the block's tokens and parent too "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--grammar-timeout",
        type=float,
        default=d.grammar_timeout,
        help="seconds a structured-output grammar (JSON schema, regex, EBNF) may take to compile, in "
        "a worker process that is killed when it runs over; the request is then rejected "
        "(HTTP 400) (default: %(default)s)",
    )
    c.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM's flag: a JSON object with method (ngram: draft the tokens "
        "that followed the latest earlier match of the last n tokens; medusa: heads on the target's "
        'last hidden state, from the checkpoint directory in "model", e.g. one written by '
        'tokenmill train-draft-head; draft_model: a smaller model with the same tokenizer, named in "model", '
        'drafting on a KV cache of its own; eagle3: an EAGLE-3 drafter checkpoint in "model" '
        "(published layout, or one written by tokenmill train-draft-head --kind eagle3) fed three of "
        "the target's layers' hidden states; mtp / deepseek_mtp: the MTP layer of a DeepSeek-V3-style "
        'target\'s own checkpoint; dflash: a DFlash block drafter checkpoint in "model" (published '
        "layout, or tokenmill train-draft-head --kind dflash) drafting all k tokens in one forward; dspark: "
        "a DFlash drafter with a sequential head and a confidence head that verifies fewer drafts when they "
        "are unlikely or the batch is compute-bound, see min_confidence / compute_bound_tokens), num_speculative_tokens "
        "(default 4), prompt_lookup_min / prompt_lookup_max (n, default 2 / 4) and "
        "disable_by_batch_size (draft nothing while more requests run, default 4) and max_verify_tokens "
        "(decodes + drafts in one step, default 16: two of the CPU int8 kernel's 8-row tiles); the output "
        "distribution is unchanged (greedy: the same tokens), also with penalties, logit_bias, min_tokens, "
        "logprobs and structured output (drafts cut where the grammar rejects them, each verified "
        'position masked); requests with "speculative": false, and constrained ones while '
        "thinking, decode without it. Default: off",
    )
    c.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        metavar="N",
        help="split every layer over N processes on this host (attention heads, MLP columns and the "
        "vocabulary; one all-reduce after attention and one after the MLP), joined by "
        "torch.distributed: gloo on CPU (each rank bound to its share of the cores), NCCL on CUDA "
        "(one GPU per rank); MoE experts split by their intermediate features, MLA by heads "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="as vLLM's flag: place whole MoE experts across the --tensor-parallel-size ranks "
        "(expert e on rank e // (experts / N)) instead of splitting every expert; tokens travel "
        "to their experts' ranks and back by all-to-all, attention stays tensor-parallel. "
        "Needs an MoE model whose expert count divides by N (default: off)",
    )
    c.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        metavar="N",
        help="split the decoder layers into N consecutive stages, each in its own process(es) (times "
        "--tensor-parallel-size); the hidden state passes between stages point to point over "
        "torch.distributed and up to N steps are in flight at once (default: %(default)s)",
    )
    c.add_argument(
        "--pipeline-layer-partition",
        default=d.pipeline_layer_partition,
        metavar="A,B,...",
        help="decoder layers per pipeline stage, e.g. 10,12 (must sum to the model's layers; "
        "default: an even split, which needs the layers to divide by --pipeline-parallel-size)",
    )
    for kind, what in (("decode", "the KV cache striped by position"), ("prefill", "a prompt's tokens split")):
        c.add_argument(
            f"--{kind}-context-parallel-size",
            type=int,
            default=getattr(d, f"{kind}_context_parallel_size"),
            metavar="N",
            help=f"context parallelism ({what} across N ranks): not built yet, only 1 is accepted "
            "(default: %(default)s)",
        )
    c.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=d.distributed_executor_backend,
        help="how the workers of a tensor- or pipeline-parallel engine start: mp (processes spawned "
        "here) or ray (Ray actors in a placement group of a local Ray cluster on 127.0.0.1, "
        "started if none runs in this process; needs the ray package) (default: %(default)s)",
    )
    c.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=d.scheduling_policy,
        help="order of waiting requests: arrival (fcfs), or the request's 'priority' field, lower "
        "first (default: %(default)s)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineArgs.from_cli_args(args).create_engine_config()


def _speculative(value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
    from tokenmill.config import SpeculativeConfig

    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_json(value if isinstance(value, str) else json.dumps(value))


def _kv_transfer(value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
    from tokenmill.kv_transfer.config import KVTransferConfig

    if value is None or isinstance(value, KVTransferConfig):
        return value
    return KVTransferConfig.from_args(None, value if isinstance(value, str) else json.dumps(value))


def _layer_partition(value: tuple[int, ...] | str) -> tuple[int, ...]:
    if not isinstance(value, str):
        return tuple(value)
    try:
        return tuple(int(part) for part in value.split(",")) if value else ()
    except ValueError:
        raise ValueError(f"--pipeline-layer-partition must be comma-separated layer counts, got {value!r}") from None
