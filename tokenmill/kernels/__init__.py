"""C++ CPU kernels, compiled on first use with the system compiler (`torch.utils.cpp_extension`).

Each kernel module keeps its source next to a Python wrapper; `build()` compiles it once per CPU
kind (`-march=native`) and returns None when that is impossible here (no compiler, no OpenMP), so
callers fall back to plain torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

_built: dict[str, object] = {}


def build(name: str, source: str, functions: list[str], extra_cflags: tuple[str, ...] = ()):
    """The compiled extension `name`, or None when it cannot be built here (logged once)."""
    if name in _built:
        return _built[name]
    module = None
    if not os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        # the build runs `ninja` from PATH; the one pip installed sits next to this Python
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(
                name=f"tokenmill_{name}_{_cpu_tag()}",  # -march=native: one build per CPU kind
                cpp_sources=source,
                functions=functions,
                extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, no OpenMP: fall back to torch ops
            logger.warning("CPU kernel %s unavailable (%s); using torch ops instead", name, e)
    _built[name] = module
    return module


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction sets, so a build cached for one CPU is never loaded on another."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]
