"""`EngineArgs`: the engine's settings as one flat set of fields, shared by every way of starting an
engine: the flags of `serve`, `generate`, `bench offline` and `eval` (`add_engine_args` / `EngineArgs.from_cli_args`),
`LLM(**kwargs)` and the draft-head trainers. Each field declares its flag (`_setting`: help text, type,
choices), and one loop registers them, so a flag and a keyword cannot drift apart (vLLM's
`EngineArgs.add_cli_args` does the same). `create_engine_config()` builds the `EngineConfig` tree
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

from tokenmill.fields import from_attributes, same_named

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
ATTENTION_BACKEND_CHOICES = _LazyNames("tokenmill.config", "ATTENTION_BACKENDS")


CPU_DEFAULTS = {
    "kv_cache_memory": 1.0,
    "gpu_memory_utilization": None,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
}
# a GPU runs a step of thousands of tokens in about the time of a few: larger steps, more sequences, and the
# KV pool sized from the device's memory (as vLLM's defaults)
CUDA_DEFAULTS = {
    "kv_cache_memory": 1.0,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
}


def device_defaults(device: str, world_size: int = 1, sized: bool = False) -> dict[str, Any]:
    """The defaults of the settings that depend on the device (`sized`: the KV cache's size was given,
    so the device's memory does not size it; with several processes it never does: one profiles alone)."""
    if not device.startswith("cuda"):
        return CPU_DEFAULTS
    return dict(CUDA_DEFAULTS, gpu_memory_utilization=None if sized or world_size > 1 else 0.9)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _max_model_len(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None


def _context_parallel_help(what: str) -> str:
    return (
        f"context parallelism: {what}; N processes holding the whole model, over "
        "torch.distributed; not with --tensor/--pipeline-parallel-size > 1 (default: %(default)s)"
    )


def _setting(
    default: Any, help: str, *, section: str | None = None, short: str | None = None, **argparse_kwargs: Any
) -> Any:
    """An `EngineArgs` field with a flag (`add_engine_args`): its default, its help text, the help section
    it opens (the fields after it are in the same one), a short flag (`-tp`) and argparse's other
    arguments (type, choices, metavar, action, nargs)."""
    flag = {"help": help, "section": section, "aliases": (short,) if short else (), "argparse": argparse_kwargs}
    return dataclasses.field(default=default, metadata={"flag": flag})


@dataclass
class EngineArgs:
    """Every engine setting, by the name of its flag (`--kv-cache-memory` is `kv_cache_memory`). The
    defaults are those of the `EngineConfig` tree (a test checks that `EngineArgs(model=None)` builds
    `EngineConfig()`); `speculative_config` and `kv_transfer_config` take a config, a dict of its
    fields or its JSON text."""

    # an alias, a .gguf file or an HF directory (None: the default model)
    model: str | None = _setting(
        DEFAULT_MODEL,
        f"model to load: an alias ({DEFAULT_MODEL}), a .gguf file, or an HF checkpoint directory "
        "with config.json and *.safetensors; never downloaded (default: %(default)s)",
        section="model",
    )
    dtype: str = _setting(
        "auto",
        "compute dtype: auto (float32 on CPU, the checkpoint's 16-bit type on CUDA), float32, "
        "bfloat16 or float16; an explicit float32 also picks the exact GGUF mode (see "
        "--quantization) (default: %(default)s)",
    )
    device: str = _setting("cpu", "torch device: cpu, cuda or cuda:N (default: %(default)s)")
    quantization: str = _setting(
        "auto",
        "weight format: gguf = keep a GGUF file's quantized blocks (Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/"
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
        choices=QUANTIZATION_CHOICES,
        metavar="METHOD",
    )
    quantization_group_size: int | None = _setting(
        None,
        "int8 / int4: input columns sharing one scale (default: int4 32, int8 one per output row)",
        type=int,
        choices=(32, 64, 128),
    )
    quantization_symmetric: bool | None = _setting(
        None,
        "int8 / int4: codes symmetric around zero (one scale per group) or asymmetric (a scale and "
        "a minimum per group, a closer fit for skewed groups) (default: int8 symmetric, int4 "
        "asymmetric)",
        action=argparse.BooleanOptionalAction,
    )
    seed: int = _setting(0, "global random seed; a request's own 'seed' overrides it (default: %(default)s)", type=int)
    # "auto": the longest context the KV cache holds
    max_model_len: int | str | None = _setting(
        None,
        "longest prompt + output in tokens; auto = the longest one sequence's KV fits in the cache "
        "(--kv-cache-memory / --num-kv-blocks, --kv-cache-dtype), at most the model's; a number larger "
        "than the cache holds is a start-time error (default: the model's context length, requests "
        "limited by the KV cache)",
        type=_max_model_len,
        metavar="TOKENS|auto",
    )
    # GiB (None: the device's default, `device_defaults`)
    kv_cache_memory: float | None = _setting(
        None,
        "memory for the paged KV cache in GiB; sets the number of blocks (default: 1, or on CUDA "
        "sized by --gpu-memory-utilization)",
        section="KV cache and scheduling",
        type=float,
        metavar="GIB",
    )
    gpu_memory_utilization: float | None = _setting(
        None,
        "CUDA: the fraction of the GPU's memory this engine may use (0-1]; the KV cache gets what "
        "the weights and a profiling step at the largest batch (--max-num-batched-tokens) leave of it "
        "(default on CUDA with one process and neither --kv-cache-memory nor --num-kv-blocks: 0.9)",
        type=float,
        metavar="FRACTION",
    )
    num_kv_blocks: int | None = _setting(
        None, "exact number of KV cache blocks (overrides --kv-cache-memory)", type=int
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "dtype the KV cache stores keys and values in: auto (float16 with the default gguf-q8 "
        "weights, else the compute dtype), float32, bfloat16 or float16; a 16-bit cache under "
        "float32 compute halves the bytes per token. int8, fp8_e4m3 (alias fp8) and fp8_e5m2 store "
        "one byte per value plus a scale per token and kv head (about 1.9x the tokens of a 16-bit "
        "cache at a little accuracy; an MLA latent cache: one scale per token) (default: %(default)s)",
        choices=KV_CACHE_DTYPE_CHOICES,
        metavar="DTYPE",
    )
    block_size: int = _setting(16, "tokens per KV cache block (default: %(default)s)", type=int)
    # None: the device's default
    max_num_seqs: int | None = _setting(
        None,
        f"most sequences running in one step (default: {CPU_DEFAULTS['max_num_seqs']} on CPU, "
        f"{CUDA_DEFAULTS['max_num_seqs']} on CUDA)",
        type=int,
    )
    # None: the device's default
    max_num_batched_tokens: int | None = _setting(
        None,
        "token budget of one step; longer prompts are prefilled in chunks (default: "
        f"{CPU_DEFAULTS['max_num_batched_tokens']} on CPU, {CUDA_DEFAULTS['max_num_batched_tokens']} on CUDA)",
        type=int,
    )
    enforce_eager: bool = _setting(
        False,
        "CUDA: run every step eagerly; by default decode steps replay CUDA graphs captured at start for "
        "padded batch sizes (default: off)",
        action="store_true",
    )
    attention_backend: str = _setting(
        "auto",
        "attention kernels: auto (triton-paged on CUDA, cpu-paged on CPU in float32, else torch-sdpa), "
        "torch-sdpa, cpu-paged, triton-paged, or on CUDA with their package installed flash-attn "
        "(FlashAttention 2's paged varlen kernel; --block-size a multiple of 256) or flashinfer (its paged "
        "prefill/decode wrapper); both 16-bit KV caches only, eager steps (default: %(default)s)",
        choices=ATTENTION_BACKEND_CHOICES,
        metavar="NAME",
    )
    cpu_offload_gb: float = _setting(
        0.0,
        "CUDA: keep this many GiB of decoder layers' weights in pinned host memory and copy each "
        "layer to the device ahead of its use (the next one streams while one runs): a model larger "
        "than the GPU's memory runs, slower by the copy time; turns CUDA graphs off (default: %(default)s)",
        type=float,
    )
    cpu_moe: bool = _setting(
        False,
        "CUDA: keep every MoE layer's experts in host memory and run them on the CPU (attention and "
        "dense layers stay on the GPU; each MoE layer's hidden states cross to the host and back) (default: off)",
        action="store_true",
    )
    n_cpu_moe: int = _setting(
        0,
        "CUDA: as --cpu-moe for the experts of the first N MoE layers only (default: %(default)s)",
        type=int,
        metavar="N",
    )
    max_step_ms: float = _setting(
        1000.0,
        "time one step should take at most: the step's token budget is lowered below "
        "--max-num-batched-tokens to what fits in it by the measured step time (a fixed part per step "
        "plus a time per token; never under 32 tokens, nor so small that the fixed part outweighs the "
        "tokens), so a long prompt's chunk cannot hold up the running requests, or the blocks of an "
        "aborted request, for much longer; it never raises the budget, so on hardware fast enough "
        "--max-num-batched-tokens alone decides, as in vLLM; 0 turns it off (default: %(default)s)",
        type=float,
    )
    long_prefill_share: float = _setting(
        0.5,
        "while another request could start, the most of a step's token budget the prompts being "
        "prefilled may take together, the rest going to the newcomers, so that a long prompt does not hold "
        "every newcomer back until it is done (as vLLM's --long-prefill-token-threshold, as a share of the "
        "budget); running decodes are scheduled first either way; 1 turns it off (default: %(default)s)",
        type=float,
    )
    enable_prefix_caching: bool = _setting(
        True,
        "reuse the KV blocks of identical prompt prefixes across requests (default: on)",
        action=argparse.BooleanOptionalAction,
    )
    prefix_cache_hash: str = _setting(
        "blake2b",
        "hash for prefix-cache block keys: blake2b = keyed with a random per-process key "
        "(collision-resistant, unpredictable), sha256 = the same keys in every process, builtin = "
        "Python's hash (fastest, 64-bit); a hit always checks the block's tokens and parent too "
        "(default: %(default)s)",
        choices=PREFIX_CACHE_HASH_CHOICES,
        metavar="HASH",
    )
    kv_cache_dir: str | None = _setting(
        None,
        "the KV cache's disk tier: full prompt blocks are written here in the background and "
        "loaded back for a later prompt with the same prefix, also after a restart and by other "
        "servers on the same directory (keyed by model, weights, quantization, KV dtype, block size "
        "and cache_salt) (default: off)",
        metavar="PATH",
    )
    # GiB
    kv_disk_size: float = _setting(
        10.0,
        "the most the disk tier's files take in GiB; the least recently used blocks are "
        "removed beyond it (default: %(default)s)",
        type=float,
        metavar="GIB",
    )
    kv_disk_min_load_tokens: int = _setting(
        16,
        "a disk-tier hit shorter than N tokens is recomputed instead of loaded (default: %(default)s)",
        type=int,
        metavar="N",
    )
    # GiB
    kv_offloading_size: float | None = _setting(
        None,
        "the KV cache's host-RAM tier (vLLM's flag): GiB of host memory (pinned on CUDA) for full "
        "blocks evicted from the pool, least recently used out first, looked up before the disk tier "
        "and handed on to it when --kv-cache-dir is set too; on CPU the pool already is RAM, so a larger "
        "pool is usually the better use of the memory (default: off)",
        type=float,
        metavar="GIB",
    )
    grammar_timeout: float = _setting(
        30.0,
        "seconds a structured-output grammar (JSON schema, regex, EBNF) may take to compile, in "
        "a worker process that is killed when it runs over; the request is then rejected "
        "(HTTP 400) (default: %(default)s)",
        type=float,
    )
    speculative_config: SpeculativeConfig | dict | str | None = _setting(
        None,
        "speculative decoding, as vLLM's flag: a JSON object with method (ngram: draft the tokens "
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
        metavar="JSON",
    )
    tensor_parallel_size: int = _setting(
        1,
        "split every layer over N processes on this host (attention heads, MLP columns and the "
        "vocabulary; one all-reduce after attention and one after the MLP), joined by "
        "torch.distributed: gloo on CPU (each rank bound to its share of the cores), NCCL on CUDA "
        "(one GPU per rank); MoE experts split by their intermediate features, MLA by heads "
        "(default: %(default)s)",
        short="-tp",
        type=int,
        metavar="N",
    )
    enable_expert_parallel: bool = _setting(
        False,
        "as vLLM's flag: place whole MoE experts across the --tensor-parallel-size ranks "
        "(expert e on rank e // (experts / N)) instead of splitting every expert; tokens travel "
        "to their experts' ranks and back by all-to-all, attention stays tensor-parallel. "
        "Needs an MoE model whose expert count divides by N (default: off)",
        action="store_true",
    )
    pipeline_parallel_size: int = _setting(
        1,
        "split the decoder layers into N consecutive stages, each in its own process(es) (times "
        "--tensor-parallel-size); the hidden state passes between stages point to point over "
        "torch.distributed and up to N steps are in flight at once (default: %(default)s)",
        short="-pp",
        type=int,
        metavar="N",
    )
    # layers per stage, or "A,B,..."
    pipeline_layer_partition: tuple[int, ...] | str = _setting(
        (),
        "decoder layers per pipeline stage, e.g. 10,12 (must sum to the model's layers; "
        "default: an even split, which needs the layers to divide by --pipeline-parallel-size)",
        metavar="A,B,...",
    )
    decode_context_parallel_size: int = _setting(
        1,
        _context_parallel_help(
            "stripe each sequence's KV cache by token over N ranks (token t on rank t %% N; each "
            "rank stores 1/N of the KV and attends its share, outputs merged by log-sum-exp)"
        ),
        type=int,
        metavar="N",
    )
    prefill_context_parallel_size: int = _setting(
        1,
        _context_parallel_help(
            "split a prompt chunk's tokens over N ranks (each runs the tokens whose KV it stores; "
            "queries all-gathered); the KV is striped as --decode-context-parallel-size stripes it"
        ),
        type=int,
        metavar="N",
    )
    distributed_executor_backend: str = _setting(
        "mp",
        "how the workers of a tensor- or pipeline-parallel engine start: mp (processes spawned "
        "here) or ray (Ray actors in a placement group of a local Ray cluster on 127.0.0.1, "
        "started if none runs in this process; needs the ray package) (default: %(default)s)",
        choices=["mp", "ray"],
    )
    scheduling_policy: str = _setting(
        "fcfs",
        "order of waiting requests: arrival (fcfs), or the request's 'priority' field, lower "
        "first (default: %(default)s)",
        choices=["fcfs", "priority"],
    )
    # disaggregated prefill/decode; None: off (`serve` sets it from --kv-role / --kv-transfer-config)
    kv_transfer_config: KVTransferConfig | dict | str | None = None
    # LoRA adapters on (implied by lora_modules): loaded at run time too
    enable_lora: bool = _setting(
        False,
        "serve LoRA adapters (implied by --lora-modules); more are loaded at run time with POST /v1/load_lora_adapter",
        section="LoRA adapters",
        action="store_true",
    )
    # name -> PEFT directory, or "name=path" strings
    lora_modules: dict[str, str] | list[str] | None = _setting(
        None,
        "LoRA adapters to load at start, each a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors); a request names one as its model",
        nargs="+",
        metavar="NAME=PATH",
    )
    max_loras: int = _setting(
        4, "adapters loaded at once (each takes a slot in every adapted layer) (default: %(default)s)", type=int
    )
    max_lora_rank: int = _setting(16, "the highest adapter rank (default: %(default)s)", type=int)

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
        values = same_named(cls, args)
        if hasattr(args, "kv_role"):
            from tokenmill.kv_transfer.config import KVTransferConfig

            values["kv_transfer_config"] = KVTransferConfig.from_args(args.kv_role, args.kv_transfer_config)
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        """The validated configuration tree (ValueError naming the setting at fault)."""
        from tokenmill.config import (
            CacheConfig,
            EngineConfig,
            LoRAConfig,
            OffloadConfig,
            ParallelConfig,
            SchedulerConfig,
        )

        lora = None
        if self.enable_lora or self.lora_modules:
            lora = LoRAConfig(_lora_modules(self.lora_modules), self.max_loras, self.max_lora_rank)

        defaults = device_defaults(
            self.device,
            self.tensor_parallel_size * self.pipeline_parallel_size,
            sized=self.kv_cache_memory is not None or self.num_kv_blocks is not None,
        )
        # each config's fields named as a setting are taken from it (`from_attributes`); the rest given here
        return from_attributes(
            EngineConfig,
            self,
            offload=OffloadConfig(self.cpu_offload_gb, self.cpu_moe, self.n_cpu_moe),
            cache=from_attributes(
                CacheConfig,
                self,
                kv_cache_memory_gib=_or(self.kv_cache_memory, defaults["kv_cache_memory"]),
                gpu_memory_utilization=_or(self.gpu_memory_utilization, defaults["gpu_memory_utilization"]),
                num_blocks=self.num_kv_blocks,
                cache_dtype=self.kv_cache_dtype,
                kv_disk_size_gib=self.kv_disk_size,
                kv_offloading_size_gib=self.kv_offloading_size,
            ),
            speculative=_speculative(self.speculative_config),
            parallel=from_attributes(
                ParallelConfig, self, pipeline_layer_partition=_layer_partition(self.pipeline_layer_partition)
            ),
            scheduler=from_attributes(
                SchedulerConfig,
                self,
                max_num_seqs=_or(self.max_num_seqs, defaults["max_num_seqs"]),
                max_num_batched_tokens=_or(self.max_num_batched_tokens, defaults["max_num_batched_tokens"]),
                policy=self.scheduling_policy,
            ),
            kv_transfer=_kv_transfer(self.kv_transfer_config),
            lora=lora,
        )


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every `EngineArgs` field declared with `_setting`, in field order and help sections.
    So a flag and an `LLM(...)` keyword cannot drift apart (`kv_transfer_config` has none: `serve` adds
    `--kv-role` / `--kv-transfer-config`)."""
    group = parser
    for name, f in _FIELDS.items():
        if "flag" not in f.metadata:
            continue
        if f.metadata["flag"]["section"] is not None:
            group = parser.add_argument_group(f.metadata["flag"]["section"])
        add_engine_arg(group, name)


def add_engine_arg(parser, name: str, help: str | None = None) -> None:
    """The flag of the `EngineArgs` field `name`: `--name-with-dashes`, the field's default and the type,
    choices, ... of its declaration; `help` in place of its own for a command that uses the setting
    otherwise (`tokenmill info` reports for it, `tokenmill plan` plans for it)."""
    flag = _FIELDS[name].metadata["flag"]
    names = ["--" + name.replace("_", "-"), *flag["aliases"]]
    parser.add_argument(*names, default=_FIELDS[name].default, help=help or flag["help"], **flag["argparse"])


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


def _lora_modules(value: dict[str, str] | list[str] | None) -> dict[str, str]:
    """{name: path} from a dict or `--lora-modules`' NAME=PATH strings."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    modules = {}
    for item in value:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        modules[name] = path
    return modules


def _layer_partition(value: tuple[int, ...] | str) -> tuple[int, ...]:
    if not isinstance(value, str):
        return tuple(value)
    try:
        return tuple(int(part) for part in value.split(",")) if value else ()
    except ValueError:
        raise ValueError(f"--pipeline-layer-partition must be comma-separated layer counts, got {value!r}") from None
