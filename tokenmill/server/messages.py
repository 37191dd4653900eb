"""The messages between the server's front end and its engine-core process, one small dataclass per
kind (pickled over two multiprocessing queues; `core_process.py` reads the first group and writes the
second, `engine_client.py` / `core_handle.py` the other way round).

Only token ids cross the boundary: tokenization and detokenization stay in the front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.outputs import EngineCoreOutput
    from tokenmill.engine.request import EngineCoreRequest

# ---- front end -> core


@dataclass(frozen=True)
class InitCore:
    """First: what the core needs from the front end's tokenizer (loaded while the core loads the weights,
    fills its KV cache and warms up).
    `tokenizer_data`: a `structured.backend.TokenizerData`, or None (structured output off)."""

    eos_token_ids: list[int]
    tokenizer_data: Any = None


@dataclass(frozen=True)
class AddRequest:
    """One sample's request (n > 1 was fanned out before)."""

    request: EngineCoreRequest


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop every cached prefix block; answered by `PrefixCacheReset`."""


@dataclass(frozen=True)
class UpdateLoRA:
    """Load the PEFT adapter at `path` as `name`, or unload `name` (path None); answered by `LoRAUpdated`."""

    name: str
    path: str | None


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- core -> front end


@dataclass(frozen=True)
class CoreReady:
    """The model is loaded: `core_process._ready_info` (model, dtype, KV cache size, pid, ...)."""

    info: dict


@dataclass(frozen=True)
class LoadFailed:
    """Loading failed; the process then exits."""

    message: str


@dataclass(frozen=True)
class StepDone:
    """After every step that ran: its outputs and `core_process.stats_snapshot`."""

    outputs: list[EngineCoreOutput]
    stats: dict


@dataclass(frozen=True)
class StatsChanged:
    """After adds or aborts that changed the queues, with no step to report them."""

    stats: dict


@dataclass(frozen=True)
class AddRejected:
    """The core refused an add (it never crashes the loop); `param`: the request field at fault,
    `code`: the kind of fault (`RequestRejected.code`)."""

    request_id: str
    message: str
    param: str | None
    code: str = "invalid_value"


@dataclass(frozen=True)
class PrefixCacheReset:
    num_blocks_dropped: int


@dataclass(frozen=True)
class LoRAUpdated:
    """The answer to `UpdateLoRA`: None, or why not and the request field at fault (None: the engine's)."""

    error: str | None = None
    param: str | None = None


@dataclass(frozen=True)
class CoreFailed:
    """The step loop raised (message with its traceback); the process then exits."""

    message: str
