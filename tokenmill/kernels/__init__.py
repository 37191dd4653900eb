"""C++ CPU kernels, compiled on first use with the system compiler (`torch.utils.cpp_extension`).

Each kernel module keeps its source next to a Python wrapper; `cpu_kernels()` compiles them all as
one extension (one translation unit, so the compiled decode step calls the very functions the
Python wrappers call), once per CPU kind (`-march=native`), and returns None when that is
impossible here (no compiler, no OpenMP), so callers fall back to plain torch ops.

The sources include ATen and torch's pybind11 casters (`PRELUDE`), not `<torch/extension.h>`: that
header adds the whole C++ frontend (modules, optimizers, autograd API), and parsing it took about
half of a build (51 of ~90 s on a 2-core Zen 3, against 27 s for the prelude).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_built: dict[str, object] = {}

# What the kernels use of torch: tensors and operators (ATen), at::parallel_for, and the bindings;
# `torch::` names ATen's, as <torch/types.h> would
PRELUDE = """
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
namespace torch { using namespace at; }
"""


def cpu_kernels():
    """The extension holding every kernel module's functions, or None when it cannot be built here.
    Built with -ffp-contract=off: no multiply-add is fused unless the source writes one."""
    from tokenmill.kernels import block_quant, decode_step, fp8_matmul, fused_ops, paged_attention

    modules = (block_quant, fused_ops, paged_attention, decode_step, fp8_matmul)
    return build("cpu", "\n".join(m._SOURCE for m in modules), [f for m in modules for f in m.FUNCTIONS],
                 extra_cflags=("-ffp-contract=off",))


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

            arch = target_arch()
            full_name = f"tokenmill_{name}_{_cpu_tag()}" + ("" if arch == "native" else f"_{arch.replace('-', '_')}")
            build_dir = _build_root() / full_name
            with _exclusive(build_dir):
                module = load_inline(
                    name=full_name,
                    cpp_sources=PRELUDE + source,
                    no_implicit_headers=True,
                    functions=functions,
                    extra_cflags=["-O3", f"-march={arch}", "-fopenmp", *extra_cflags],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as e:  # no compiler, no ninja, no OpenMP: fall back to torch ops
            logger.warning("CPU kernel %s unavailable (%s); using torch ops instead", name, e)
    _built[name] = module
    return module


def target_arch() -> str:
    """The -march the kernels are built for: `native` (every instruction set this CPU has: AVX2 and
    FMA select the vector paths), or $TOKENMILL_CPU_ARCH, e.g. `x86-64` for the portable scalar
    paths (what a CPU without AVX2 runs; the tests build it to check those paths too)."""
    return os.environ.get("TOKENMILL_CPU_ARCH", "native")


def _build_root() -> Path:
    """Where builds are cached: $TORCH_EXTENSIONS_DIR, else ~/.cache/tokenmill/kernels."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenmill", "kernels")
    return Path(root)


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """Hold the build directory against other tokenmill processes.

    torch guards a build with a `lock` file that stays behind when the building process is killed,
    and every later build then waits on it forever. An `flock` dies with its holder, so while we hold
    one no live build is in progress here and a leftover `lock` file is stale: remove it.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tokenmill.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction sets, so a build cached for one CPU is never loaded on another."""
    flags = " ".join(sorted(cpu_flags()))
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]
