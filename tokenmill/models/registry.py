"""Which model file implements which architecture: the one list of supported architectures.

Each HF `architectures` name (and each GGUF `general.architecture`) maps to a module under
`tokenmill.models` and a class in it; the module is imported only when that architecture is loaded.
A model class names its config class (`config_class`, a `ModelConfig` subclass that reads the
architecture's own fields).
"""

from __future__ import annotations

import importlib

# HF architecture name -> (module under tokenmill.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}

# GGUF general.architecture -> HF architecture name
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}  # "llama" with experts (expert_count) is Mixtral; "deepseek2" with sigmoid gating is DeepSeek-V3

# embedding checkpoints saved from a bare decoder (e.g. Qwen3-Embedding's layout: no LM head, tensor
# names without "model.") -> the architecture whose decoder they hold; loaded headless
HEADLESS_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(architecture: str):
    """The model class for an HF architecture name (imports its module on first use)."""
    check_architecture(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"tokenmill.models.{module}"), name)


def config_from_hf_dict(cfg: dict):
    """The `ModelConfig` (the architecture's subclass) for the contents of an HF `config.json`."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model class to use")
    decoder = HEADLESS_ARCHITECTURES.get(archs[0])
    if decoder is not None:  # no head to load: tie one to the embedding, and serve embeddings only
        cfg = {**cfg, "architectures": [decoder], "tie_word_embeddings": True}
    config = model_class(cfg["architectures"][0]).config_class.from_hf_dict(cfg)
    config.headless = decoder is not None
    return config
