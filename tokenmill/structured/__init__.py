"""Structured output (xgrammar-constrained decoding), tool calling and reasoning parsing.

* `spec`: `StructuredOutputSpec` (json / json_object / regex / choice / grammar) and `ReasoningSpec`,
  carried on `SamplingParams`; `check_spec` validates without compiling.
* `backend`: tokenizer data for xgrammar, the caching thread-pool `GrammarCompiler`, the per-request
  `GrammarMatcher`, bitmask helpers.
* `manager`: the engine core's per-request state and the batched bitmask step.
* `reasoning`: `<think>` parsers for responses and streams.
* `tools`: tool-calling prompts, constraints and output parsers.
"""

from tokenmill.structured.spec import ReasoningSpec, StructuredOutputSpec, check_spec

__all__ = ["ReasoningSpec", "StructuredOutputSpec", "check_spec"]
