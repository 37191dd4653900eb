"""C++ CPU kernels (csrc/ at the repository root), with a Python wrapper module per kernel family here.

All of them are one extension module, built when the package is installed (setup.py) once per
instruction-set variant (`variants`: portable x86-64, AVX2, AVX2 + AVX-VNNI, AVX-512 + VNNI);
`cpu_kernels()` loads the best variant this CPU runs, so a first start compiles nothing. Where no
prebuilt variant fits (another architecture), it is missing (installed without them, or built against
another torch) or the sources have changed since the install, it builds them from source into a cache
instead, once per CPU kind (`-march=native`, or the variant's flags; about a minute on two cores),
saying so in the log. It returns None when neither
works here (no compiler, no OpenMP), so callers fall back to plain torch ops.

$TOKENMILL_CPU_ARCH chooses the build: a variant's name loads that variant (`x86-64`: the portable
scalar paths; `haswell`: AVX2 without VNNI; the tests run both), any other -march builds from source.
$TOKENMILL_DISABLE_CPU_KERNELS=1 turns the kernels off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import platform
import sys
from pathlib import Path

from tokenmill.kernels import variants

logger = logging.getLogger(__name__)

_loaded: list[object] = []  # [the module, or None], once looked for


def cpu_kernels():
    """The extension holding every kernel function, or None when it cannot be loaded nor built here."""
    if not _loaded:
        _loaded.append(None if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS") else _load())
    return _loaded[0]


def _load():
    arch = os.environ.get("TOKENMILL_CPU_ARCH")
    variant = variants.named(arch) if arch else variants.best_for(cpu_flags())
    if variant is None:
        why = f"$TOKENMILL_CPU_ARCH={arch} is not a prebuilt variant" if arch else "no prebuilt variant for this CPU"
    else:
        module, why = _prebuilt(variant)
        if module is not None:
            logger.info("CPU kernels: prebuilt variant %s", variant.name)
            return module
    source = variants.sources_dir()
    if source is None:
        logger.warning("CPU kernels unavailable (%s, and no sources to build); using torch ops instead", why)
        return None
    march = arch or (variant.name if variant else "native")
    logger.warning("CPU kernels: building from source for %s (%s)", march, why)
    return build_from_source(source, march)


def _prebuilt(variant: variants.Variant):
    """(the variant's installed module, "") or (None, why it cannot be used)."""
    import torch  # noqa: F401  (the module links to torch's libraries: loaded first, or its import fails)

    try:
        module = importlib.import_module(f"{__name__}.{variant.module}")
    except ImportError as e:
        return None, f"prebuilt variant {variant.name} not installed ({e})"
    source = variants.sources_dir()
    if source is not None and module.sources_hash != variants.sources_hash(source):
        return None, f"prebuilt variant {variant.name} was built from other sources than {source} (reinstall)"
    return module, ""


def build_from_source(source: Path, march: str, name: str = "cpu"):
    """The sources in `source` compiled for -march `march` (`native`, or a variant's name: its flags) into
    the cache (`_build_root`), or None when that fails here (logged)."""
    # the build runs `ninja` from PATH; the one pip installed sits next to this Python
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    target = variants.Variant(march, frozenset())
    full_name = build_name(source, march, name)
    build_dir = _build_root() / full_name
    try:
        from torch.utils.cpp_extension import load

        with _exclusive(build_dir):
            return load(
                name=full_name,
                sources=[str(p) for p in variants.sources(source)],
                extra_cflags=[*target.cflags, *variants.CFLAGS, f"-DTM_SOURCES_HASH={variants.sources_hash(source)}"],
                extra_ldflags=list(variants.LDFLAGS),
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, no OpenMP: fall back to torch ops
        logger.warning("CPU kernels unavailable (%s); using torch ops instead", e)
        return None


def build_name(source: Path, march: str, name: str = "cpu") -> str:
    """The cached build's module (and directory) name: this CPU's tag, the sources' hash (so trees with
    different csrc/ never rebuild over each other) and, for a variant, its name."""
    suffix = "" if march == "native" else variants.Variant(march, frozenset()).module.removeprefix("_cpu")
    return f"tokenmill_{name}_{_cpu_tag()}_{variants.sources_hash(source)[:10]}{suffix}"


def _build_root() -> Path:
    """Where builds from source are cached: $TORCH_EXTENSIONS_DIR, else ~/.cache/tokenmill/kernels."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenmill", "kernels"
    )
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
