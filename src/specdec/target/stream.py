"""The streaming linear kernel (kernels/stream.cpp): built once per machine on first use, then loaded from
the cache. None where it cannot run (not x86 with AVX2, no C++ compiler, SPECDEC_STREAM=0): the lean
runner then falls back to oneDNN/torch linears (packed.py).

Why a kernel of our own: a decode step reads every weight once, and oneDNN's small-row GEMMs stream them
at ~60% of the bandwidth (docs/history/benchmarks-engine-llamacpp.md); this one reaches `torch.sum`'s
speed, keeps any weight precision with fp32 accumulation, and gives every row the same bits whatever else
is in the call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, cache_dir

SOURCES = [Path(__file__).with_name("kernels") / f for f in ("stream.cpp", "fused.cpp", "quant.cpp")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]  # no contraction: sums in source order
# the same per-lane operations in 16-lane vectors: the same bits, fewer instructions (torch's AVX512 level
# implies BW, VL and DQ: the integer kernels use BW)
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
PANEL = 16  # outputs per panel (stream.cpp's P)


def _cpu_has(flag: str) -> bool:
    """A /proc/cpuinfo flag (Linux); False where that cannot be read."""
    try:
        return any(line.startswith("flags") and flag in line.split() for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def _usable() -> str | None:
    """Why the kernel cannot be used here, or None."""
    switch = os.environ.get("SPECDEC_STREAM", "1")
    if switch not in ("0", "1"):
        raise SpecdecError(f"SPECDEC_STREAM must be 0 (use oneDNN/torch linears) or 1 (the default), got {switch!r}")
    if switch == "0":
        return "SPECDEC_STREAM=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU has no AVX2"
    return None


_LOCK = threading.Lock()


def kernel():
    """The compiled module (`pack`, `linear`), or None with one warning saying why. Built or loaded once
    per process, also when several threads build runners at once."""
    with _LOCK:
        return _kernel()


@functools.cache
def _kernel():
    why = _usable()
    if why is not None:
        return None
    flags = FLAGS + (AVX512 if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])
    if "-mavx512bw" in flags and _cpu_has("avx512_vnni"):  # fused multiply-adds of the same integers
        flags.append("-mavx512vnni")
    key = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in SOURCES), " ".join(flags).encode(),
                                      torch.__version__.encode(), sys.version.encode()])).hexdigest()[:16]
    name = f"specdec_stream_{key}"
    build = cache_dir() / "kernels" / f"stream-{key}"
    try:
        so = build / f"{name}.so"
        mod = _import(name, so) if so.exists() else _build(name, flags, build)
        _self_check(mod)
    except Exception as e:  # a machine without a compiler still decodes, on the slower kernels
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        warnings.warn(f"specdec: the streaming linear kernel is unavailable ({first}); using oneDNN/torch linears",
                      stacklevel=2)
        return None
    return mod


kernel.cache_clear = _kernel.cache_clear  # forget the result (tests)


def _build(name: str, flags: list[str], build: Path):
    """Compile in a private directory that then takes `build`'s place: a build killed half-way leaves
    nothing behind (torch's own lock file would make every later build wait for it forever), and two
    processes building at once each finish."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    with atomic_dir(build) as tmp:
        return load(name, [str(f) for f in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(tmp), verbose=False)


def _import(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja`; the PyPI wheel puts it next to this interpreter."""
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _self_check(mod) -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(37, 70, generator=g), torch.randn(5, 70, generator=g)
    y = mod.linear(x, mod.pack(w), 37, torch.ones(48), torch.zeros(48))
    if not torch.allclose(y, F.linear(x, w), atol=1e-4):
        raise RuntimeError("self-check failed: results differ from F.linear")
    if not torch.equal(torch.cat([mod.linear(x[i:i + 1], mod.pack(w), 37, torch.ones(48), torch.zeros(48))
                                  for i in range(5)]), y):
        raise RuntimeError("self-check failed: rows depend on each other")


class StreamWeight:
    """One weight [O, K] in panels for the kernel, stored in its own dtype (float32, bfloat16, float16, or
    int8 with one fp32 scale per output); bias folded in. Calls take and return fp32."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> None:
        mod = kernel()
        self.out_features = w.shape[0]
        pad = -(-self.out_features // PANEL) * PANEL

        def padded(v: torch.Tensor | None, fill: float) -> torch.Tensor:
            out = torch.full((pad,), fill, dtype=torch.float32)
            if v is not None:
                out[: self.out_features] = v.float()
            return out

        self.scale, self.bias = padded(scale, 1.0), padded(bias, 0.0)
        self.w = mod.pack(w.contiguous())
        self._linear = mod.linear

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._linear(x, self.w, self.out_features, self.scale, self.bias, residual)
