"""Shared test helpers: tiny random-weight HF models saved to disk, and reference comparisons."""

from __future__ import annotations

import random

import numpy as np
import torch
import transformers

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import UniProcExecutor
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

TINY_BASE = dict(  # what every tiny model shares (TINY_MODELS adds its own fields)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    initializer_range=0.05,
)

# name -> (config class, extra config fields)
TINY_MODELS = {
    "llama-mha": (transformers.LlamaConfig, dict(num_key_value_heads=4)),
    "llama-gqa-untied": (transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-tied": (transformers.LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope-head-dim": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "qwen2-bias": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-window": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=24)),
    # head_dim 128 apart from hidden/heads, as in Qwen3 (and what transformers assumes reading its GGUF)
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)),
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # layer 1 dense (mlp_only_layers), layer 0 routed + the gated shared expert; no renormalisation
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    # sliding window (8) far shorter than the prompts; global layers with their own rope base
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    # soft-capped attention scores and final logits
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # longrope (a 4x longer context than the original 1024: attention factor ~1.1), fused q/k/v and gate/up
    "phi3": (
        transformers.Phi3Config,
        dict(
            num_key_value_heads=2,
            max_position_embeddings=4096,
            original_max_position_embeddings=1024,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.1 * i for i in range(8)],
            },
        ),
    ),
    "phi3-window-partial": (
        transformers.Phi3Config,
        dict(
            num_key_value_heads=4,
            sliding_window=16,
            partial_rotary_factor=0.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True
        ),
    ),
    # MLA with queries straight from the hidden state; layer 0 dense, layer 1 greedy top-2 of 4 + a shared expert
    "deepseek-v2": (
        transformers.DeepseekV2Config,
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    ),
    # low-rank queries, v wider than the no-rope key part, yarn (factor 4, mscale), group-limited routing
    "deepseek-v2-yarn": (
        transformers.DeepseekV2Config,
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    # sigmoid routing with a correction bias (random: see make_tiny_model), grouped top-2, renormalised
    "deepseek-v3": (
        transformers.DeepseekV3Config,
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
        ),
    ),
    # sinks, biases everywhere, alternating window (8) / full layers, yarn; a swiglu_limit the random
    # activations cross, so the clamps bite (biases and sinks random: see make_tiny_model)
    "gpt-oss": (
        transformers.GptOssConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.3,
        ),
    ),
}


def make_tiny_model(name: str, directory, **overrides) -> transformers.PreTrainedModel:
    """Build a random-weight model from a transformers config (with `overrides` of its fields), save it
    to `directory`, return it."""
    cls, extra = TINY_MODELS[name]
    torch.manual_seed(0)
    config = cls(**{**TINY_BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for module in model.modules():  # DeepSeek-V3's router bias starts at zero: make it choose
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(std=0.05)
        for name in ("sinks", "gate_up_proj_bias", "down_proj_bias"):  # GPT-OSS's start at zero
            if hasattr(module, name):
                getattr(module, name).data.normal_(std=0.5 if name == "sinks" else 0.05)
    model.save_pretrained(directory)
    return model


def make_core(
    model: str,
    num_blocks: int = 512,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    eos_token_ids=(),
    max_model_len: int | None = None,
    loaded=None,
    prefix_caching: bool = True,
    policy: str = "fcfs",
    cache_dtype: str = "auto",
    speculative=None,
    tokenizer_data=None,
    max_step_ms: float = 1000.0,
) -> EngineCore:
    """`max_step_ms`: the step budget's time bound (0: every step may take max_num_batched_tokens, so that
    where prompts are cut into chunks does not depend on how fast the machine ran the steps before)."""
    config = EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching, cache_dtype=cache_dtype
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            max_step_ms=max_step_ms,
        ),
        speculative=speculative,
    )
    executor = UniProcExecutor(config, loaded or load_model(model))
    return EngineCore(config, executor, set(eos_token_ids), tokenizer_data=tokenizer_data)


def make_runner(loaded, num_blocks: int = 32, cache_dtype: str = "auto"):
    """A model runner over `loaded` (a LoadedModel) with a KV cache of `num_blocks` blocks."""
    executor = UniProcExecutor(EngineConfig(cache=CacheConfig(num_blocks=num_blocks, cache_dtype=cache_dtype)), loaded)
    executor.initialize_kv_cache()
    return executor.runner


def all_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence prefilled from an empty cache (runner: a ModelRunner)."""
    blocks = list(range(-(-len(ids) // runner.kv_cache_config.block_size)))
    with torch.inference_mode():
        tables = [blocks] * len(runner.kv_cache_config.pool_blocks)  # the same blocks in every pool
        hidden, _ = runner.forward(np.array(ids), np.array([len(ids)]), np.array([0]), [tables])
        return runner.model.compute_logits(hidden).float()


def assert_matches_dense(dense, exact, fast) -> None:
    """`exact` (a LoadedModel in float32 activations) gives the logits of `dense` (a transformers model
    holding the same dequantized weights) to float precision; `fast` (int8 activations) within 5%."""
    exact_runner, fast_runner = make_runner(exact), make_runner(fast)
    rng = random.Random(1)
    for n in (1, 7, 20):
        ids = [rng.randrange(256) for _ in range(n)]
        with torch.no_grad():
            ref = dense(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(
            all_logits(exact_runner, ids), ref, rtol=0, atol=1e-4 * max(1.0, float(ref.abs().max()))
        )
        got = all_logits(fast_runner, ids)
        assert ((got - ref).norm() / ref.norm()).item() < 0.05


def top1_agreement(ref, quant) -> tuple[float, float]:
    """Top-1 agreement and the largest relative logit error of two loaded models over a fixed text
    (teacher-forced): the bounded quality measure of lossy weight formats."""
    ref_runner, quant_runner = make_runner(ref), make_runner(quant)
    agree = total = 0
    errors = []
    for i in range(4):
        ids = [(7 * i + 3 * j) % 256 for j in range(48)]
        a, b = all_logits(ref_runner, ids), all_logits(quant_runner, ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        errors.append(((a - b).norm() / a.norm()).item())
    return agree / total, max(errors)


def run_core(
    core: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    on_step=None,
    logprobs: dict | None = None,
) -> dict[str, list[int]]:
    """Run prompts to completion through the engine core; returns generated ids by request id (and
    fills `logprobs`, if given, with each request's logprobs entries)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    out: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(str(i), p, sp))
        out[str(i)] = []
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
            if logprobs is not None and o.new_logprobs:
                logprobs.setdefault(o.request_id, []).extend(o.new_logprobs)
        if on_step:
            on_step(core)
    return out


def greedy_reference(hf_model, prompt: list[int], max_new_tokens: int):
    """transformers' greedy continuation and the logits it chose from at each step."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        res = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return res.sequences[0, len(prompt) :].tolist(), [s[0] for s in res.scores]


def assert_same_greedy(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], tie: float = 1e-5) -> None:
    """Token-exact, except that comparison stops at a step where the reference's top-2 logits tie."""
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= tie, f"greedy diverged at step {step}: ours {a}, reference {b}, top-2 gap {gap:.2e}"
            return
    assert len(ours) == len(ref)


def assert_greedy_of(hf_model, prompt: list[int], ours: list[int], max_new_tokens: int, tie: float = 1e-5) -> None:
    """`ours` is transformers' greedy continuation of `prompt` (`max_new_tokens` tokens), checked as
    `assert_same_greedy` checks it against `greedy_reference`, in one teacher-forced forward pass over
    the prompt and our tokens instead of generate's one pass per token: greedy picks each token as the
    argmax of the logits after the tokens before it, so while our tokens are transformers' so far, the
    logits at our step k are the ones generate chose its step k from (to float rounding), and at the
    first step where they differ the tie rule reads the same logits. (Generate's token-by-token decode
    is most of what a reference costs: 70 ms a token for the default model.)"""
    ids = prompt + ours[: max_new_tokens - 1]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), logits_to_keep=len(ids) - len(prompt) + 1).logits[0]
    assert_same_greedy(ours, logits.argmax(-1).tolist(), logits, tie)


_GGUF_ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}  # else llama
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _add_deepseek_metadata(w, c) -> None:
    """What llama.cpp's converter writes for DeepSeek-V2/V3 in its MLA layout (one latent kv head)."""
    import gguf

    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    v3 = c.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 or c.topk_method == "group_limited_greedy":
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_tiny_gguf(hf: transformers.PreTrainedModel, path, qtypes: dict[str, str], tokenizer_from=None) -> None:
    """Write a tiny HF model (Llama, Mixtral, Qwen2/3, Qwen2/3-MoE, Phi-3, DeepSeek-V2/V3) as a GGUF file
    the way llama.cpp's converter does (q/k rows permuted for Llama; experts stacked per layer; DeepSeek's
    kv_b split into k_b and v_b). `qtypes` maps a GGUF
    tensor-name suffix (e.g. "attn_q", "output", "ffn_up_exps") to a quantization type name (Q4_0,
    Q4_1, Q8_0); everything else is stored as F32. `tokenizer_from`: a GGUF file whose tokenizer fields
    are copied (llama.cpp loads no file without one; its vocabulary must be the model's)."""
    import gguf
    from gguf.quants import quantize

    c = hf.config
    arch = _GGUF_ARCH.get(c.model_type, "llama")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "deepseek2":
        w.add_head_count_kv(1)
        _add_deepseek_metadata(w, c)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if hasattr(c, "norm_topk_prob"):
            w.add_expert_weights_norm(c.norm_topk_prob)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors as tensors, as llama.cpp writes them
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and arch != "deepseek2":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))

    def permute(t, heads):
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def tensors():
        for name, tensor in hf.state_dict().items():
            t = tensor.float().numpy()
            if name == "model.embed_tokens.weight":
                yield "token_embd.weight", t
            elif name == "model.norm.weight":
                yield "output_norm.weight", t
            elif name == "lm_head.weight":
                if not c.tie_word_embeddings:
                    yield "output.weight", t
            else:
                _, _, layer, *rest = name.split(".")
                if rest == ["mlp", "experts", "gate_up_proj"]:  # [E, 2I, H] in memory: gate rows, then up
                    gate, up = np.split(t, 2, axis=1)
                    yield f"blk.{layer}.ffn_gate_exps.weight", gate
                    yield f"blk.{layer}.ffn_up_exps.weight", up
                    continue
                if rest == ["mlp", "experts", "down_proj"]:
                    yield f"blk.{layer}.ffn_down_exps.weight", t
                    continue
                if rest == ["mlp", "gate", "e_score_correction_bias"]:
                    yield f"blk.{layer}.exp_probs_b.bias", t
                    continue
                if rest == ["self_attn", "kv_b_proj", "weight"]:  # split per head; k_b transposed
                    kv_b = t.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
                    yield (
                        f"blk.{layer}.attn_k_b.weight",
                        np.ascontiguousarray(kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1)),
                    )
                    yield f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, c.qk_nope_head_dim :])
                    continue
                *module, kind = rest
                part = _GGUF_LAYER_NAMES[".".join(module)]
                if arch == "llama" and part == "attn_q":
                    t = permute(t, c.num_attention_heads)
                elif arch == "llama" and part == "attn_k":
                    t = permute(t, c.num_key_value_heads)
                elif part == "ffn_gate_inp_shexp":
                    t = t.reshape(-1)  # llama.cpp stores the shared expert's gate as a vector
                yield f"blk.{layer}.{part}.{kind}", t

    if tokenizer_from is not None:
        for field in gguf.GGUFReader(tokenizer_from).fields.values():
            if field.name.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(field.name, field.contents(), field.types[0], sub)
    for out, t in tensors():
        qtype = qtypes.get(out.split(".")[-2]) if out.endswith(".weight") and t.ndim >= 2 else None
        if qtype:
            w.add_tensor(out, quantize(t, gguf.GGMLQuantizationType[qtype]), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# a small evaluation task (multiple choice and log-likelihood items) for `tokenmill eval`
EVAL_ITEMS = [
    {"context": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "gold": 0},
    {"context": "Two plus two equals", "choices": [" five", " four", " seven"], "gold": 1},
    {"context": "The opposite of hot is", "choices": [" warm", " big", " cold"], "gold": 2},
]


def hf_from_gguf(path, scratch) -> transformers.PreTrainedModel:
    """transformers' float32 model on a GGUF file's weights (the reference), read from a copy of the
    file in directory `scratch` without its tokenizer metadata: gguf-py's reader, under transformers'
    loader, spends a minute on a 262k-token vocabulary's arrays, which the model does not use. The copy
    keeps every other key/value pair, the tensor table and the tensor data byte for byte, and states
    the vocabulary's size (`{arch}.vocab_size`), which transformers otherwise counts from the tokens.
    transformers' loader also builds gguf-py's tensor-name map once per submodule (313 times for
    Gemma 3, a fifth of its load); it is a pure function of (architecture, layers), so it is built
    once here: the same names, the same tensors."""
    import functools
    import mmap
    import struct
    from pathlib import Path
    from unittest import mock

    import gguf

    from tokenmill.loader.gguf_file import GGUFFile

    src, dst = Path(path), Path(scratch) / Path(path).name
    f = GGUFFile(src)
    arch = f.fields["general.architecture"]
    keep = [k for k in f.fields if not k.startswith("tokenizer.") and k != f"{arch}.vocab_size"]
    key = f"{arch}.vocab_size".encode()
    vocab = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, len(f.fields["tokenizer.ggml.tokens"]))
    with open(src, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m, open(dst, "wb") as out:
        out.write(m[:8] + struct.pack("<QQ", len(f.tensors), len(keep) + 1))
        for k in keep:
            out.write(m[slice(*f.field_spans[k])])
        out.write(vocab + m[slice(*f.table_span)])
        out.write(b"\0" * (-out.tell() % f.alignment))
        out.write(m[f.data_start :])
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(dst.parent), gguf_file=dst.name, dtype=torch.float32
        ).eval()


def reference_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' (summed logprob, all-greedy) of the continuation's tokens after the context's."""
    ids, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    assert ids[: len(context_ids)] == context_ids, "the continuation must start a new token"
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    picked = range(len(context_ids), len(ids))
    return (sum(lp[j - 1, ids[j]].item() for j in picked), all(int(lp[j - 1].argmax()) == ids[j] for j in picked))


def check_eval_result(result: dict, items: list[dict], hf_model, tokenizer) -> None:
    """A multiple-choice `tokenmill eval` result against transformers, choice by choice."""
    assert result["items"] == len(items)
    correct = 0
    for item, got in zip(items, result["per_item"]):
        want = [reference_loglikelihood(hf_model, tokenizer, item["context"], c)[0] for c in item["choices"]]
        assert max(abs(a - b) for a, b in zip(got["loglikelihoods"], want)) < 1e-3
        assert got["pick"] == want.index(max(want))
        correct += got["pick"] == item["gold"]
    assert result["acc"] == correct / len(items)


def make_lora_adapter(base, directory, seed: int, **lora_args) -> None:
    """A PEFT LoRA adapter of `base` with random A and B (PEFT starts B at zero), saved to `directory`."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_args))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(std=0.2)
    model.save_pretrained(directory)
    model.unload()  # leaves `base` as it was


# Prepended to a kernel test's script (a fresh process): every float tensor `torch.empty` / `empty_like`
# makes is NaN, so an output a kernel allocates and leaves partly unwritten fails the comparison.
POISONED_EMPTY = r"""
import torch
_empty, _empty_like = torch.empty, torch.empty_like

def _nan(t):
    return t.fill_(float("nan")) if t.is_floating_point() else t

torch.empty = lambda *a, **k: _nan(_empty(*a, **k))
torch.empty_like = lambda *a, **k: _nan(_empty_like(*a, **k))
"""
