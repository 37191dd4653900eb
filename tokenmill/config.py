"""All configuration in one dataclass tree, validated when it is built.

`EngineConfig` holds the KV cache settings (`CacheConfig`) and the scheduler limits
(`SchedulerConfig`), plus which model runs where, in which dtype and weight format. The model's
architecture (`ModelConfig`, and each model file's subclass of it) is read from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.models.registry import check_architecture
from tokenmill.quantization import QUANTIZATION_METHODS

ATTENTION_BACKENDS = ("auto", "torch-sdpa", "cpu-paged", "triton-paged", "flash-attn", "flashinfer")
# the backends that need packages of their own, (import name, how to install it) each: the library, and
# Triton, whose kernels write their caches
OPTIONAL_ATTENTION_PACKAGES = {
    "flash-attn": (("flash_attn", "pip install flash-attn"), ("triton", "pip install triton")),
    "flashinfer": (("flashinfer", "pip install flashinfer-python"), ("triton", "pip install triton")),
}
PREFIX_CACHE_HASHES = ("blake2b", "sha256", "builtin")  # see tokenmill.engine.kv_cache_manager

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# what the KV cache may store besides those: one byte per value and a scale per token and kv head
# (tokenmill.attention.kv_quant); "fp8" is e4m3, as in vLLM
_KV_DTYPES = {
    **_DTYPES,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto", *_KV_DTYPES)  # the names --kv-cache-dtype takes


def check_positive_ints(owner: object, names: tuple[str, ...], prefix: str = "") -> None:
    """ValueError naming the first of `owner`'s fields `names` that is not a positive integer (a bool is
    not one: True would pass as 1)."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{prefix}{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """Architecture facts every decoder has, from an HF config.json or GGUF metadata. Each model
    file subclasses it for its own fields (`architecture_fields`); `tokenmill.models.registry`
    picks the subclass by architecture name."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str | None = None  # the checkpoint's own dtype, if it says
    headless: bool = False  # an embedding checkpoint without an LM head: embeddings only, no generation
    supported_activations: ClassVar[tuple[str, ...]] = ("silu",)  # what the model file's MLP computes

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.hidden_act not in self.supported_activations:
            raise ValueError(
                f"model config: hidden_act {self.hidden_act!r} is not supported "
                f"(only {', '.join(self.supported_activations)})"
            )
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            ),
            "model config: ",
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.rope_scaling is not None:
            kind = rope_type(self.rope_scaling)
            if kind not in ("default", "linear", "llama3", "yarn", "longrope", "su"):
                raise ValueError(
                    f"model config: rope_scaling type {kind!r} is not supported "
                    "(supported: default, linear, llama3, yarn, longrope)"
                )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the contents of an HF `config.json` (transformers 4.x or 5.x layout)."""
        arch = (cfg.get("architectures") or [None])[0]
        check_architecture(arch)
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_type(rope_params) != "default" else None)
        if rope_type(rope_scaling) in ("longrope", "su"):  # the factor is of the config's context, not the engine's
            original = rope_scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
            rope_scaling = {
                "factor": cfg.get("max_position_embeddings", original) / original,
                **rope_scaling,
                "original_max_position_embeddings": original,
            }
        heads = cfg["num_attention_heads"]
        fields = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
        return cls(**{**fields, **cls.architecture_fields(cfg)})

    @classmethod
    def architecture_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The subclass's own fields, read from the same config.json contents (they may also replace
        common ones an architecture spells differently)."""
        return {}


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks (explicit, or from a memory budget)."""

    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    num_blocks: int | None = None  # overrides kv_cache_memory_gib when set
    # CUDA: the fraction of the device's memory this engine may use; the KV pool gets what a profiling
    # step at the largest batch leaves of it (overrides kv_cache_memory_gib; num_blocks overrides it)
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "blake2b"  # keyed per process; or "sha256" (same in every process), "builtin"
    cache_dtype: str = "auto"  # dtype of stored K/V (int8 / fp8: quantized); "auto": see resolve_cache_dtype
    # the disk tier (tokenmill.kv_transfer.disk_tier): full prompt blocks kept in this directory
    kv_cache_dir: str | None = None
    kv_disk_size_gib: float = 10.0  # the most the tier's files take (LRU eviction beyond)
    kv_disk_min_load_tokens: int = 16  # shorter disk hits are recomputed (on CPU a load wins from one block)
    # the host-RAM tier (tokenmill.kv_transfer.host_tier): GiB for blocks evicted from the pool; None: off
    kv_offloading_size_gib: float | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, ("block_size",))
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be positive (GiB), got {self.kv_cache_memory_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.prefix_cache_hash not in PREFIX_CACHE_HASHES:
            raise ValueError(
                f"prefix_cache_hash must be one of {', '.join(PREFIX_CACHE_HASHES)}, got {self.prefix_cache_hash!r}"
            )
        resolve_cache_dtype(self.cache_dtype, torch.float32)  # raises for an unknown name
        if not self.kv_disk_size_gib >= 0:
            raise ValueError(f"kv_disk_size must be >= 0 (GiB), got {self.kv_disk_size_gib}")
        if not isinstance(self.kv_disk_min_load_tokens, int) or self.kv_disk_min_load_tokens < 0:
            raise ValueError(f"kv_disk_min_load_tokens must be an integer >= 0, got {self.kv_disk_min_load_tokens!r}")
        if self.kv_offloading_size_gib is not None and not self.kv_offloading_size_gib > 0:
            raise ValueError(f"kv_offloading_size must be > 0 (GiB), got {self.kv_offloading_size_gib}")


@dataclass
class SchedulerConfig:
    """Per-step limits: how many sequences and how many tokens one forward pass may hold."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | str | None = None  # None: the model's context length; "auto": what the KV cache holds
    policy: str = "fcfs"  # or "priority": lower `priority` values run first
    # a step's token budget shrinks below max_num_batched_tokens so that a step takes about this long at
    # the measured per-token time (`engine/step_budget.py`); 0 turns it off
    max_step_ms: float = 1000.0
    # while another request could start, the prompts being prefilled take at most this share of a step's
    # token budget together, the rest left to it: else a long prompt takes whole steps until it is done and
    # holds every newcomer back that long (vLLM's long_prefill_token_threshold, as a share of the budget, which
    # max_step_ms moves); 1 turns it off
    long_prefill_share: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.long_prefill_share, (int, float)) or not 0 < self.long_prefill_share <= 1:
            raise ValueError(f"long_prefill_share must be in (0, 1], got {self.long_prefill_share!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        check_positive_ints(self, ("max_num_seqs", "max_num_batched_tokens"))
        if self.max_model_len is not None and self.max_model_len != "auto":
            if not isinstance(self.max_model_len, int) or self.max_model_len <= 0:
                raise ValueError(f"max_model_len must be a positive integer or 'auto', got {self.max_model_len!r}")
        if not isinstance(self.max_step_ms, (int, float)) or not 0 <= self.max_step_ms < float("inf"):
            raise ValueError(f"max_step_ms must be a number >= 0 (0: no bound), got {self.max_step_ms!r}")

    @property
    def fixed_max_model_len(self) -> int | None:
        """The asked length when it is a number (None: the model's own, or "auto": known once the KV
        cache is sized)."""
        return None if self.max_model_len == "auto" else self.max_model_len


@dataclass
class OffloadConfig:
    """Hybrid CPU-GPU inference on a CUDA device (`tokenmill.worker.offload`): `cpu_offload_gb` GiB of
    decoder layers' weights kept in pinned host memory and streamed to the device ahead of use (vLLM's
    --cpu-offload-gb); `cpu_moe` keeps every MoE layer's experts on the host, `n_cpu_moe` those of the
    first N MoE layers, run there by the CPU expert code while attention and dense parts stay on the
    device (llama.cpp's --cpu-moe / --n-cpu-moe)."""

    cpu_offload_gb: float = 0.0
    cpu_moe: bool = False
    n_cpu_moe: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_offload_gb, (int, float)) or not 0 <= self.cpu_offload_gb < float("inf"):
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {self.cpu_offload_gb!r}")
        if isinstance(self.n_cpu_moe, bool) or not isinstance(self.n_cpu_moe, int) or self.n_cpu_moe < 0:
            raise ValueError(f"n_cpu_moe must be an integer >= 0, got {self.n_cpu_moe!r}")
        if self.cpu_moe and self.n_cpu_moe:
            raise ValueError("cpu_moe (every MoE layer's experts) and n_cpu_moe (the first N) exclude each other")

    @property
    def active(self) -> bool:
        return self.cpu_offload_gb > 0 or self.cpu_moe or self.n_cpu_moe > 0


SPECULATIVE_METHODS = ("ngram", "medusa", "draft_model", "eagle3", "mtp", "deepseek_mtp", "dflash", "dspark")
SPECULATIVE_MODEL_METHODS = ("medusa", "draft_model", "eagle3", "dflash", "dspark")  # the methods that read `model`


@dataclass
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, JSON with these fields, as vLLM's): each decode
    step of an eligible request also verifies up to `num_speculative_tokens` drafted tokens.
    `ngram`: the tokens after the latest earlier match of the sequence's last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`. `medusa`: the heads in the checkpoint directory
    `model` (`tokenmill.spec_decode.medusa`; at most one draft per head) draft from the target's last
    hidden state during the step itself. `draft_model`: the model `model` (an alias, a GGUF file or an
    HF directory with the target's tokenizer) drafts on a KV cache of its own, during the step
    (`tokenmill.spec_decode.draft_model`: argmax, or sampled from its own distribution for sampling
    requests). `eagle3`: the EAGLE-3 drafter in the checkpoint directory `model` (one decoder layer
    over the target's hidden states of three layers, `tokenmill.spec_decode.eagle`); `mtp` (alias
    `deepseek_mtp`): the multi-token-prediction layer of a DeepSeek-V3-style target's own checkpoint
    (`tokenmill.spec_decode.mtp`); both draft k tokens autoregressively on a small KV cache of their
    own, fed the target's hidden states every step. `dflash`: the DFlash block drafter in `model`
    (`tokenmill.spec_decode.dflash`: all k drafts from one non-causal forward over a block of mask
    tokens, conditioned on several target layers); `dspark`: a DFlash drafter with a sequential head
    over the block and a confidence head (`tokenmill.spec_decode.dspark`): a draft is verified only
    while the product of the confidences so far is at least `min_confidence`, and, once a step's rows
    (decodes + drafts) pass `compute_bound_tokens`, at least the step's expected tokens per row. Nothing is drafted while more than
    `disable_by_batch_size` requests run (a full batch gains little from verifying drafts), and a
    step's decodes plus drafts stay within `max_verify_tokens` (on CPU the quantized kernels multiply
    register tiles of 8 rows per pass over the weights: a step much past 16 rows costs ~linearly
    more). Drafts are sized per
    request by its recent acceptance rate a (an average over its verify steps): position i is drafted
    only while a**i >= 1 - (1 - `min_acceptance`) / B with B requests running — a verified token
    costs about half a single-stream decode step on a 2-core CPU (a small fraction on a memory-bound
    GPU), and in a batch of B a token is worth only 1/B of a step, so unlikely drafts cost more than
    they save; a request that drafts nothing drifts back to trying. `min_acceptance` 0 turns the
    sizing off (always up to `num_speculative_tokens`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4
    max_verify_tokens: int = 16
    min_acceptance: float = 0.5
    min_confidence: float = 0.3  # dspark: the least predicted chance of a draft being accepted worth verifying
    compute_bound_tokens: int = 16  # dspark: rows per step past which verifying costs compute
    model: str | None = None  # medusa: the heads' checkpoint directory; draft_model: the draft; others: the drafter

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if self.method == "deepseek_mtp":
            self.method = "mtp"
        if (self.method in SPECULATIVE_MODEL_METHODS) != (self.model is not None):
            raise ValueError(
                "speculative_config.model (a Medusa heads directory, the draft model or an EAGLE-3 / DFlash / "
                "DSpark checkpoint) is required by methods medusa and draft_model and eagle3 and dflash and "
                "dspark and only by them, "
                f"got method {self.method!r} with model {self.model!r}"
            )
        check_positive_ints(
            self,
            (
                "num_speculative_tokens",
                "prompt_lookup_min",
                "prompt_lookup_max",
                "disable_by_batch_size",
                "max_verify_tokens",
                "compute_bound_tokens",
            ),
            "speculative_config.",
        )
        if not isinstance(self.min_acceptance, (int, float)) or not 0 <= self.min_acceptance < 1:
            raise ValueError(f"speculative_config.min_acceptance must be in [0, 1), got {self.min_acceptance!r}")
        if not isinstance(self.min_confidence, (int, float)) or not 0 <= self.min_confidence < 1:
            raise ValueError(f"speculative_config.min_confidence must be in [0, 1), got {self.min_confidence!r}")
        if self.num_speculative_tokens > 15:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be at most 15 (a verify step of at most "
                f"16 tokens), got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From `--speculative-config` (a JSON object); unknown fields are an error naming them."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown fields {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return cls(**raw)


@dataclass
class ParallelConfig:
    """How one engine spreads over processes: `tensor_parallel_size` ranks, each a process on this host
    holding its share of every layer (heads, MLP columns, vocabulary), joined by torch.distributed
    (gloo on CPU, NCCL on CUDA with one GPU per rank). On CPU each rank is bound to its share of the cores.
    `enable_expert_parallel`: MoE layers place whole experts across those ranks instead of splitting
    each expert (`tokenmill.distributed.expert_parallel`)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # pipeline parallelism: the decoder layers in this many stages of tensor_parallel_size ranks each
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] = ()  # layers per stage (empty: an even split)
    distributed_executor_backend: str = "mp"  # "mp": worker processes; "ray": Ray actors in a placement group
    # context parallelism (vLLM's flags; `tokenmill.attention.context_parallel`): a sequence's KV cache
    # striped by token over the ranks (decode), a prompt's tokens split over them (prefill)
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_positive_ints(
            self,
            (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "decode_context_parallel_size",
                "prefill_context_parallel_size",
            ),
        )
        self.pipeline_layer_partition = tuple(self.pipeline_layer_partition)
        partition = self.pipeline_layer_partition
        if partition and (len(partition) != self.pipeline_parallel_size or min(partition) < 1):
            raise ValueError(
                f"--pipeline-layer-partition {','.join(map(str, partition))} must give a positive "
                f"number of layers to each of the {self.pipeline_parallel_size} pipeline stages"
            )
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"--distributed-executor-backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}"
            )
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        """The layouts context parallelism runs in, else an error naming the flags: one context-parallel
        group of N ranks (N = the larger size; the other 1 or N too), each holding the whole model, or,
        decode only, the N tensor-parallel ranks themselves (vLLM's sharing); no pipeline stages."""
        dcp, pcp, tp = self.decode_context_parallel_size, self.prefill_context_parallel_size, self.tensor_parallel_size
        if dcp > 1 and pcp > 1 and dcp != pcp:
            raise ValueError(
                f"--decode-context-parallel-size {dcp} and --prefill-context-parallel-size {pcp}: both "
                "split one group of ranks (a prompt's KV is stored in the decode layout), so give the same "
                "size or leave one at 1"
            )
        if self.context_parallel_size == 1:
            return
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "--decode-context-parallel-size / --prefill-context-parallel-size > 1 do not run with "
                "--pipeline-parallel-size > 1 yet"
            )
        if tp > 1 and (pcp > 1 or dcp != tp):
            raise ValueError(
                f"--tensor-parallel-size {tp} with context parallelism: decode context parallelism shares "
                f"the tensor-parallel ranks (--decode-context-parallel-size {tp}); prefill context "
                "parallelism runs with --tensor-parallel-size 1"
            )

    @property
    def context_parallel_size(self) -> int:
        """Ranks a sequence's KV cache is striped over (1: no context parallelism)."""
        return max(self.decode_context_parallel_size, self.prefill_context_parallel_size)

    @property
    def world_size(self) -> int:
        """Processes of one engine: a tensor-parallel group per pipeline stage, or the context-parallel group."""
        return max(self.tensor_parallel_size * self.pipeline_parallel_size, self.context_parallel_size)


@dataclass
class LoRAConfig:
    """LoRA adapters (`--lora-modules`, `--max-loras`, `--max-lora-rank`): `max_loras` adapters are
    loaded at once (each in a slot of every adapted layer's stacked weights), of rank up to
    `max_lora_rank`; `modules` (name -> PEFT directory) are loaded at start, more at run time."""

    modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an int >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be an int >= 1, got {self.max_lora_rank!r}")
        if len(self.modules) > self.max_loras:
            raise ValueError(f"--lora-modules names {len(self.modules)} adapters; --max-loras is {self.max_loras}")
        for name in self.modules:
            if not name or "=" in name:
                raise ValueError(
                    f"--lora-modules: a LoRA adapter's name must be non-empty and free of '=', got {name!r}"
                )


@dataclass
class EngineConfig:
    """Everything the engine needs. `model` is an alias, a .gguf file or an HF directory."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    quantization: str = "auto"  # one of tokenmill.quantization.QUANTIZATION_METHODS
    quantization_group_size: int | None = None  # int8 / int4 on load: columns per scale (None: the method's default)
    quantization_symmetric: bool | None = None  # int8 / int4 on load: no per-group minimum (None: int8 yes, int4 no)
    grammar_timeout: float = 30.0  # seconds a structured-output grammar may take to compile
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, no CUDA graphs
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS ("auto": attention/selector.py chooses)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None  # disaggregated prefill/decode (--kv-role); None: off
    lora: LoRAConfig | None = None  # LoRA adapters (--enable-lora / --lora-modules); None: off
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # weights / experts kept on the host (CUDA)

    def __post_init__(self) -> None:
        device = resolve_device(self.device)
        if self.offload.active and device.type != "cuda":
            raise ValueError(
                "cpu_offload_gb, cpu_moe and n_cpu_moe keep weights in host memory beside a CUDA device; "
                f"the device is {self.device}, where every weight is in host memory already"
            )
        if self.offload.active and self.parallel.world_size > 1:
            raise ValueError(
                "cpu_offload_gb, cpu_moe and n_cpu_moe run in one process: not with tensor or pipeline parallelism"
            )
        if self.cache.gpu_memory_utilization is not None and device.type != "cuda":
            raise ValueError(f"gpu_memory_utilization sizes the KV cache on CUDA; the device is {self.device}")
        if self.cache.gpu_memory_utilization is not None and self.parallel.world_size > 1:
            raise ValueError(
                "gpu_memory_utilization profiles one process's step; with tensor or pipeline parallelism "
                "size the KV cache with --kv-cache-memory or --num-kv-blocks"
            )
        check_attention_backend(self.attention_backend, device)
        if self.attention_backend != "auto" and self.parallel.context_parallel_size > 1:
            raise ValueError(
                "--attention-backend cannot be chosen with --decode/--prefill-context-parallel-size > 1 "
                "(context parallelism runs its own attention backend)"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(sorted(_DTYPES))}, got {self.dtype!r}")
        if not self.grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be positive, got {self.grammar_timeout}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}"
            )
        if self.quantization_group_size is not None and self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size}")
        if self.quantization not in ("int8", "int4") and (
            self.quantization_group_size or self.quantization_symmetric is not None
        ):
            raise ValueError(
                "quantization_group_size and quantization_symmetric apply to --quantization int8 / "
                f"int4, not {self.quantization!r}"
            )
        if (
            self.speculative is not None
            and self.speculative.method != "ngram"
            and self.parallel.tensor_parallel_size > 1
        ):
            raise ValueError(
                f"speculative_config.method {self.speculative.method} does not run with "
                "--tensor-parallel-size > 1 yet (ngram does)"
            )
        if self.speculative is not None and self.parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not run with --pipeline-parallel-size > 1 yet")
        self._check_context_parallel()
        if self.lora is not None and (
            self.parallel.tensor_parallel_size > 1
            or self.parallel.pipeline_parallel_size > 1
            or self.speculative is not None
            or self.kv_transfer is not None
        ):
            raise ValueError(
                "LoRA adapters run on one process without speculative decoding or a KV transfer yet "
                "(no --tensor-parallel-size / --pipeline-parallel-size > 1, --speculative-config, --kv-role)"
            )

    def _check_context_parallel(self) -> None:
        """What context parallelism does not run with yet, refused at start naming the flags: each rank
        holds every block id but only its stripe of each block's tokens."""
        cp = self.parallel.context_parallel_size
        if cp == 1:
            return
        flags = "--decode-context-parallel-size / --prefill-context-parallel-size"
        if self.cache.block_size % cp:
            raise ValueError(f"{flags} {cp}: --block-size {self.cache.block_size} must divide by {cp}")
        others = {
            "--speculative-config": self.speculative,
            "--enable-lora / --lora-modules": self.lora,
            "--kv-role": self.kv_transfer,
            "--kv-offloading-size": self.cache.kv_offloading_size_gib,
            "--kv-cache-dtype int8 / fp8": self.cache.cache_dtype if _quantized_cache(self.cache.cache_dtype) else None,
        }
        for flag, value in others.items():
            if value is not None:
                raise ValueError(f"{flags} {cp} does not run with {flag} yet")


def _quantized_cache(name: str) -> bool:
    return name == "int8" or name.startswith("fp8")


def check_attention_backend(name: str, device: torch.device) -> None:
    """Refuse at start an attention backend that is unknown, or that cannot run here: FlashAttention and
    FlashInfer run on CUDA with their package installed (the error names it)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name in OPTIONAL_ATTENTION_PACKAGES:
        if device.type != "cuda":
            raise ValueError(f"attention_backend {name} runs on CUDA; the device is {device.type}")
        for package, install in OPTIONAL_ATTENTION_PACKAGES[name]:
            if importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"attention_backend {name} needs the {package} package, which is not installed ({install})"
                )


def resolve_device(device: str | torch.device) -> torch.device:
    """Check that the device exists here; a clear error instead of a CUDA stack trace."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported (supported: cpu, cuda)")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
    """Pick the compute dtype. 'auto' is float32 on CPU (no fast bf16 matmul there) and the
    checkpoint's 16-bit dtype (or bfloat16) on CUDA."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            chosen = torch.float32
        else:
            chosen = _DTYPES.get(str(checkpoint_dtype), torch.bfloat16)
            if chosen == torch.float32:
                chosen = torch.bfloat16
            if chosen == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                chosen = torch.float16
    elif dtype in _DTYPES:
        chosen = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(sorted(_DTYPES))}, got {dtype!r}")
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {chosen} is not supported (float32, bfloat16, float16)")
    if device.type == "cuda" and chosen == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(device)}; use float16")
    return chosen


def resolve_cache_dtype(cache_dtype: str, compute_dtype: torch.dtype, quantization: str = "none") -> torch.dtype:
    """The dtype K/V are stored in: the one named, or for 'auto' float16 under the fast GGUF mode
    (`gguf-q8`, not exact anyway: half the bytes per token, as llama.cpp's default cache), else the
    compute dtype. int8 and fp8 caches are quantized (see tokenmill.attention.kv_quant)."""
    if cache_dtype != "auto":
        if cache_dtype not in _KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {', '.join(sorted(_KV_DTYPES))}, got {cache_dtype!r}"
            )
        return _KV_DTYPES[cache_dtype]
    return torch.float16 if quantization == "gguf-q8" else compute_dtype
