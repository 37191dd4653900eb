"""The builds of the C++ CPU kernels (csrc/): one extension module per instruction-set level, as llama.cpp's
GGML_CPU_ALL_VARIANTS and vLLM's CPU extension build them, the best one picked at run time from the CPU's
flags so that a package built on one x86-64 machine runs the fastest path its sources have on another.

The levels are those the sources' #ifdefs tell apart: none (the portable scalar paths), AVX2 + FMA + F16C
(the vector paths; int8 dot products with `maddubs`), and on top VNNI's `vpdpbusd` in its AVX-512 form or
in its AVX-VNNI form (Intel's client cores without AVX-512). A variant is named by the -march it is built
with, plus `+feature` for each -m<feature> on top, so that $TOKENMILL_CPU_ARCH names one the way it names
a -march for a build from source.

Standard library only: setup.py loads this file on its own, before the package is importable.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

# What every build adds to its -march: -ffp-contract=off, so that no multiply-add is fused unless the
# source writes one (the kernels promise float32 results bit for bit those of the torch path).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

# /proc/cpuinfo flags of the x86-64 micro-architecture levels: what the compiler may use on its own at
# -march=haswell (x86-64-v3; the instructions only intrinsics emit, such as AES, are not in the sources)
# and at -march=x86-64-v4.
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    name: str  # "<march>" or "<march>+<feature>...": the flags, and the $TOKENMILL_CPU_ARCH that picks it
    needs: frozenset[str]  # the CPU flags its code may use

    @property
    def cflags(self) -> tuple[str, ...]:
        march, *features = self.name.split("+")
        return (f"-march={march}", *(f"-m{f}" for f in features))

    @property
    def module(self) -> str:
        """Its extension module's name inside `tokenmill.kernels`."""
        return "_cpu_" + re.sub(r"\W", "_", self.name)


VARIANTS = (  # worst to best
    Variant("x86-64", frozenset()),
    Variant("haswell", frozenset(_V3)),
    Variant("haswell+avxvnni", frozenset(_V3 | {"avx_vnni"})),
    Variant("x86-64-v4+avx512vnni", frozenset(_V4 | {"avx512_vnni"})),
)


def best_for(flags: frozenset[str]) -> Variant | None:
    """The best variant whose instruction sets this CPU has all of (None: not an x86-64 CPU)."""
    if "lm" not in flags:  # x86-64's long mode; an aarch64 CPU's `Features` line has no such flag
        return None
    return [v for v in VARIANTS if v.needs <= flags][-1]


def named(name: str) -> Variant | None:
    return next((v for v in VARIANTS if v.name == name), None)


def sources_dir() -> Path | None:
    """The C++ sources: shipped inside the package (a wheel), or csrc/ of the source tree (an editable
    install, a checkout on PYTHONPATH); None when neither is here."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parents[1] / "csrc"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    return None


def sources(directory: Path) -> list[Path]:
    """The files to compile (every .cpp) of a sources directory."""
    return sorted(directory.glob("*.cpp"))


def sources_hash(directory: Path) -> str:
    """A digest of every source and header: a prebuilt module built from other sources is not loaded."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
