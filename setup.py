"""The native kernels (src/specdec/runtime/kernels) compiled when the package installs, for this machine,
as the module specdec.runtime._kernels. Everything else is in pyproject.toml.

torch must be importable while building: install it first, then `pip install --no-build-isolation .`
(pip's isolated build environment has no torch, and fetching one there would pull a multi-GB CUDA build).
Where the kernels cannot be built here (no torch at build time, no compiler, not x86-64 with AVX2), the
install still succeeds and specdec builds them on first use instead."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _say(msg: str) -> None:
    print(f"specdec: {msg}", file=sys.stderr)


def _kernel_build():
    """src/specdec/runtime/kernel_build.py, loaded by path (importing specdec would need its dependencies)."""
    spec = importlib.util.spec_from_file_location("_specdec_kernel_build", HERE / "src/specdec/runtime/kernel_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _native():
    """setup()'s ext_modules and cmdclass for the kernels, or none of either with one line saying why."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say("torch is not importable while building (an isolated build?): the native kernels will be built "
             "on first use (install torch first, then pip install --no-build-isolation, to build them now)")
        return [], {}
    kb = _kernel_build()
    why = kb.unsupported()
    if why is not None:
        _say(f"not building the native kernels: {why}")
        return [], {}
    flags = kb.host_flags()

    class OptionalBuild(BuildExtension):
        """BuildExtension with the flags the kernels' own build uses (not Python's CFLAGS: -fwrapv and -g
        would make another binary than the one first use builds), and a failure that leaves the install
        without them rather than failing it."""

        def build_extensions(self):
            for attr in ("compiler_so", "compiler_so_cxx"):  # the C and the C++ command (ninja reads the first)
                cmd = getattr(self.compiler, attr, None)
                if cmd:
                    setattr(self.compiler, attr, cmd[:1] + ["-fPIC"])
            super().build_extensions()

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                _say(f"could not build the native kernels ({first}); they will be built on first use")

    kb.ninja_on_path()
    ext = CppExtension(kb.PREBUILT, [str(f.relative_to(HERE)) for f in kb.SOURCES],
                       extra_compile_args=flags + [kb.key_define(kb.build_key(flags))], extra_link_args=kb.LDFLAGS)
    return [ext], {"build_ext": OptionalBuild}


ext_modules, cmdclass = _native()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
