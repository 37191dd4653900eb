"""Builds the C++ CPU kernels (csrc/) when the package is installed: one extension module per
instruction-set variant (tokenmill/kernels/variants.py), each from the same sources with its own -march,
so that `tokenmill.kernels.cpu_kernels()` loads the best one this CPU runs and compiles nothing.
Everything else about the package is in pyproject.toml.

It builds against the torch already installed, so install with `pip install --no-build-isolation`
(as the Makefile does): an isolated build would fetch some other torch to build against (from PyPI, the
CUDA wheels) and the modules would not match the torch that runs them. Without torch at hand, or on
a CPU other than x86-64, it builds no module and the kernels are built from source at first use.
The compile flags are those of that run-time build (`torch.utils.cpp_extension.load`): Python's own
CFLAGS (-g, -fwrapv, -DNDEBUG, ...) are left out.
"""

import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _variants():
    spec = importlib.util.spec_from_file_location("tokenmill_kernel_variants", ROOT / "tokenmill/kernels/variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildPyWithSources(build_py):
    """Also ships the C++ sources inside the package (tokenmill/kernels/csrc), for the build from
    source on a CPU without a prebuilt variant."""

    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads csrc/ where it is
            target = Path(self.build_lib) / "tokenmill" / "kernels" / "csrc"
            target.mkdir(parents=True, exist_ok=True)
            for path in CSRC.iterdir():
                shutil.copy2(path, target / path.name)


def kernel_build():
    """(ext_modules, cmdclass) of the kernel variants; no modules where they cannot be built here."""
    cmdclass = {"build_py": BuildPyWithSources}
    if platform.machine() not in ("x86_64", "AMD64"):
        print("tokenmill: no prebuilt CPU kernels for", platform.machine(), "(built from source at first use)")
        return [], cmdclass
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "tokenmill: torch is not importable here (install with --no-build-isolation): "
            "no prebuilt CPU kernels (built from source at first use)"
        )
        return [], cmdclass

    class BuildVariants(BuildExtension):
        """torch's build, with each variant's objects in their own directory (the sources are shared),
        and the flags of the run-time build."""

        def build_extensions(self):
            python_cflags = set(sysconfig.get_config_var("CFLAGS").split())
            for command in ("compiler_so", "linker_so", "linker_so_cxx"):
                if hasattr(self.compiler, command):
                    flags = [f for f in getattr(self.compiler, command) if f not in python_cflags]
                    setattr(self.compiler, command, flags)
            super().build_extensions()

        def build_extension(self, ext):
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rpartition(".")[2])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    # torch's build runs `ninja` from PATH (all of a variant's sources at once); pip's sits next to this Python
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    variants = _variants()
    sources = [str(p.relative_to(ROOT)) for p in variants.sources(CSRC)]
    headers = [str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.h"))]
    digest = variants.sources_hash(CSRC)
    modules = [
        CppExtension(
            f"tokenmill.kernels.{v.module}",
            sources,
            depends=headers,
            extra_compile_args=[*v.cflags, *variants.CFLAGS, f"-DTM_SOURCES_HASH={digest}"],
            extra_link_args=list(variants.LDFLAGS),
        )
        for v in variants.VARIANTS
    ]
    return modules, {**cmdclass, "build_ext": BuildVariants}


ext_modules, cmdclass = kernel_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
