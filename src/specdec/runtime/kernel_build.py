"""What one build of the native kernels (kernels/*.cpp) is: its sources, its compiler flags for this
machine and the key naming both. setup.py compiles them at install with these, and stream.py uses that
module only where its key is the key of the sources and machine it runs on, else builds its own: the two
never disagree on what a build is. Imports nothing of specdec's, so setup.py can load it by its path."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / f for f in ("stream.cpp", "fused.cpp", "quant.cpp", "interleaved.cpp", "layers.cpp",
                                       "random.cpp")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]  # no contraction: sums in source order
# the same per-lane operations in 16-lane vectors: the same bits, fewer instructions (torch's AVX512 level
# implies BW, VL and DQ: the integer kernels use BW)
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
LDFLAGS = ["-fopenmp"]
PREBUILT = "specdec.runtime._kernels"  # the module setup.py compiles


def cpu_has(flag: str) -> bool:
    """A /proc/cpuinfo flag (Linux); False where that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def unsupported() -> str | None:
    """Why this machine cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU has no AVX2"
    return None


def host_flags() -> list[str]:
    """The flags for this machine: AVX2, plus AVX-512 where torch runs its own AVX-512 code, plus VNNI."""
    flags = FLAGS + (AVX512 if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])
    if "-mavx512bw" in flags and cpu_has("avx512_vnni"):  # fused multiply-adds of the same integers
        flags.append("-mavx512vnni")
    return flags


def build_key(flags: list[str]) -> str:
    """Names a build: every kernel source and header, the flags, torch's and Python's versions (the
    module's ABI)."""
    files = sorted(KERNELS.glob("*.cpp")) + sorted(KERNELS.glob("*.h"))
    parts = [p for f in files for p in (f.name.encode(), f.read_bytes())]
    parts += [" ".join(flags).encode(), torch.__version__.encode(), sys.version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def key_define(key: str) -> str:
    """The compiler flag that embeds the key in the module (its `build_key`)."""
    return f"-DSPECDEC_BUILD_KEY={key}"


def ninja_on_path() -> None:
    """torch's extension builder runs `ninja`; the PyPI wheel puts it next to this interpreter."""
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
