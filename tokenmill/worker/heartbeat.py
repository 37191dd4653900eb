"""Progress inside a step, for the server's watchdog.

The server's engine core runs in a process of its own, and the front end restarts it when it makes no
progress for `--watchdog-timeout` seconds. Steps end rarely on a busy machine (a long prefill chunk
on two cores takes seconds), so "no step ended" cannot tell a slow core from a stuck one. The front
end hands the core a counter in shared memory (`attach`); the model runner bumps it once per step and
before every attention layer runs (`install`), so a core that is only slow moves it several times a
second while a stuck one (deadlocked, stopped) leaves it still. Without a counter (the Python API,
worker ranks) nothing is installed and `beat` does nothing.
"""

from __future__ import annotations

from torch import nn

_counter = None  # a multiprocessing.Value("Q") shared with the front end, or None


def attach(counter) -> None:
    """Count this process's progress in `counter` (call before the model runner is built)."""
    global _counter
    _counter = counter


def beat() -> None:
    if _counter is not None:
        _counter.value += 1


def install(model: nn.Module) -> None:
    """Beat before each attention layer of `model` runs (the modules that declare a KV spec), when a
    counter is attached."""
    if _counter is None:
        return
    for module in model.modules():
        if hasattr(module, "kv_spec"):
            module.register_forward_pre_hook(lambda *_: beat())
