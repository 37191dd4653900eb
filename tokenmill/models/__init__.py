"""Model classes by the HF `architectures` name they implement."""

from torch import nn

from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
