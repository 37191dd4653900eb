"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""

from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
