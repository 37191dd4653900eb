"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch.

`LLM` and `SamplingParams` are loaded on first use (module `__getattr__`), not here: the router, the
bench client and the disaggregation proxy import `tokenmill.*` too, and must not pay for torch and
the engine they never use.
"""

from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "tokenmill.entrypoints.llm", "SamplingParams": "tokenmill.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
