"""The streaming linear kernel (kernels/stream.cpp) and the other native kernels in its module: compiled
when the package installs (setup.py), else built once per machine on first use and loaded from the cache.
None where it cannot run (not x86 with AVX2, no C++ compiler, SPECDEC_STREAM=0): the lean runner then falls
back to oneDNN/torch linears (packed.py).

Why a kernel of our own: a decode step reads every weight once, and oneDNN's small-row GEMMs stream them
at ~60% of the bandwidth (docs/history/benchmarks-engine-llamacpp.md); this one reaches `torch.sum`'s
speed, keeps any weight precision with fp32 accumulation, and gives every row the same bits whatever else
is in the call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, atomic_write_text, cache_dir
from specdec.runtime import kernel_build
from specdec.sampling import race, uniform64

PANEL = 16  # outputs per panel (stream.cpp's P)
PREBUILT = kernel_build.PREBUILT


def _usable() -> str | None:
    """Why the kernel cannot be used here, or None."""
    switch = os.environ.get("SPECDEC_STREAM", "1")
    if switch not in ("0", "1"):
        raise SpecdecError(f"SPECDEC_STREAM must be 0 (use oneDNN/torch linears) or 1 (the default), got {switch!r}")
    if switch == "0":
        return "SPECDEC_STREAM=0"
    return kernel_build.unsupported()


_LOCK = threading.Lock()


def kernel():
    """The compiled module (`pack`, `linear`), or None with one warning saying why. Loaded once per
    process, also when several threads build runners at once: the module compiled at install where it
    was built from these sources for this machine, else one built here on first use and cached."""
    with _LOCK:
        return _kernel()


@functools.cache
def _kernel():
    why = _usable()
    if why is not None:
        return None
    flags = kernel_build.host_flags()
    key = kernel_build.build_key(flags)
    try:
        mod, why = _prebuilt(key)
        if mod is None:
            mod = _jit(key, flags, why)
        _self_check_once(mod)
    except Exception as e:  # a machine without a compiler still decodes, on the slower kernels
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        warnings.warn(f"specdec: the streaming linear kernel is unavailable ({first}); using oneDNN/torch linears",
                      stacklevel=2)
        return None
    return mod


kernel.cache_clear = _kernel.cache_clear  # forget the result (tests)


def _prebuilt(key: str):
    """(the module compiled at install, None), or (None, why it cannot serve): absent, or built from
    other sources, flags or torch than this process's (an editable install whose sources changed since,
    a wheel from another machine)."""
    try:
        mod = importlib.import_module(PREBUILT)
    except ModuleNotFoundError as e:
        if e.name != PREBUILT:
            raise
        return None, "none installed"
    except ImportError as e:  # built against another torch or Python
        return None, (str(e).strip().splitlines() or [type(e).__name__])[0]
    if getattr(mod, "build_key", None) != key:
        return None, "the installed build is of other sources or for another machine"
    return mod, None


def _jit(key: str, flags: list[str], why: str):
    """The kernels built here (once per machine and key, then loaded from the cache)."""
    name = f"specdec_stream_{key}"
    build = cache_dir() / "kernels" / f"stream-{key}"
    so = build / f"{name}.so"
    if so.exists():
        return _import(name, so)
    print(f"specdec: native kernels not built at install ({why}); building them now (needs g++)", file=sys.stderr)
    mod = _build(name, flags + [kernel_build.key_define(key)], build)
    mod.__file__ = str(so)  # it was loaded from the private directory that has since taken `build`'s name
    return mod


def _build(name: str, flags: list[str], build: Path):
    """Compile in a private directory that then takes `build`'s place: a build killed half-way leaves
    nothing behind (torch's own lock file would make every later build wait for it forever), and two
    processes building at once each finish."""
    from torch.utils.cpp_extension import load

    kernel_build.ninja_on_path()
    with atomic_dir(build) as tmp:
        return load(name, [str(f) for f in kernel_build.SOURCES], extra_cflags=flags,
                    extra_ldflags=kernel_build.LDFLAGS, build_directory=str(tmp), verbose=False)


def _import(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_mark(mod) -> Path:
    """Where a passed self-check of this module's binary is recorded: named by the digest of the .so itself,
    so a rebuild (another compiler, other sources) is checked again."""
    digest = hashlib.sha256(Path(mod.__file__).read_bytes()).hexdigest()[:16]
    return cache_dir() / "kernels" / "checked" / digest


def _self_check_once(mod) -> None:
    """_self_check, once per build rather than once per process."""
    mark = _check_mark(mod)
    if mark.exists():
        return
    _self_check(mod)
    atomic_write_text(mark, "passed the self-check\n")


def _self_check(mod) -> None:
    """Every op the runners call, on a small problem, against its torch form, and rows independent of each
    other: a miscompiled build (an old compiler, a CPU flag misread) falls back to torch instead of
    decoding wrong tokens."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(37, 70, generator=g), torch.randn(5, 70, generator=g)
    y = mod.linear(x, mod.pack(w), 37, torch.ones(48), torch.zeros(48))
    _agree("linear", y, F.linear(x, w), [mod.linear(x[i:i + 1], mod.pack(w), 37, torch.ones(48), torch.zeros(48))
                                         for i in range(5)])
    h, nw = torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    _agree("rms_norm", mod.rms_norm(h, nw, 1e-6), F.rms_norm(h, (32,), nw, 1e-6),
           [mod.rms_norm(h[i:i + 1], nw, 1e-6) for i in range(5)])
    gu = torch.randn(5, 48, generator=g) * 4
    _agree("silu_mul", mod.silu_mul(gu), F.silu(gu[:, :24]) * gu[:, 24:], [mod.silu_mul(gu[i:i + 1]) for i in range(5)])
    _check_rope_attend(mod, g)
    _check_x16(mod, g)
    seed = 2**64 - 5  # the whole 64-bit range
    u = mod.uniform64(seed, 1000)
    if not torch.equal(u, uniform64(seed, 1000)):
        raise RuntimeError("self-check failed: uniform64 differs from sampling.uniform64")
    p = torch.softmax(torch.randn(1000, generator=g) * 3, -1)
    if mod.race(p, u) != race(p, u):
        raise RuntimeError("self-check failed: race differs from sampling.race")


def _check_x16(mod, g: torch.Generator) -> None:
    """qlinear16 on 16 Q8_0 rows re-laid by repack16: the values kept, the product as the float one's
    (up to the activations' int8 rounding), rows independent."""
    blocks = torch.randint(-127, 128, (16, 2, 34), generator=g, dtype=torch.int8).view(torch.uint8)
    blocks[:, :, :2] = torch.tensor([0x1F, 0x20], dtype=torch.uint8)  # fp16 scale ~0.008
    w = blocks.reshape(16, 68).contiguous()
    w16, x = mod.repack16(w, 8), torch.randn(5, 64, generator=g)
    dense = mod.qdequant(w, 8, 64, torch.arange(16))
    if not torch.equal(mod.qdequant16(w16, 8, 64, torch.arange(16)), dense):
        raise RuntimeError("self-check failed: repack16 changed the weights' values")
    y = mod.qlinear16(x, [w16], [8])
    if (y - F.linear(x, dense)).abs().max() > 0.02 * F.linear(x, dense).abs().max():
        raise RuntimeError("self-check failed: qlinear16 differs from torch's")
    if not torch.equal(torch.cat([mod.qlinear16(x[i:i + 1], [w16], [8]) for i in range(5)]), y):
        raise RuntimeError("self-check failed: qlinear16's rows depend on each other")


def _check_rope_attend(mod, g: torch.Generator) -> None:
    """rope_store (q and k rotated as llama.apply_rope, k and v written to the cache) and attend (softmax
    attention of each row over exactly its visible columns) on a 2-head-group layer of 5 rows after 3."""
    n, nh, nkv, hd, start = 5, 4, 2, 16, 3
    qkv = torch.randn(n, (nh + 2 * nkv) * hd, generator=g)
    ang = torch.rand(n, hd // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1), torch.cat([-ang.sin(), ang.sin()], 1)  # as llama.Rope
    kc, vc = torch.randn(nkv, start + n + 2, hd, generator=g), torch.randn(nkv, start + n + 2, hd, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    heads = qkv[:, :(nh + nkv) * hd].view(n, nh + nkv, hd)
    rotated = heads * cos[:, None] + heads.view(n, nh + nkv, 2, hd // 2).flip(2).view(n, nh + nkv, hd) * sin[:, None]
    want_k[:, start:start + n] = rotated[:, nh:].transpose(0, 1)
    want_v[:, start:start + n] = qkv[:, (nh + nkv) * hd:].view(n, nkv, hd).transpose(0, 1)
    q = mod.rope_store(qkv, cos, sin, kc, vc, start, nh, nkv)
    _agree("rope_store", q, rotated[:, :nh].reshape(n, nh * hd), [])
    _agree("rope_store's cache write", torch.cat([kc, vc]), torch.cat([want_k, want_v]), [])
    tree = torch.zeros(n, start + n, dtype=torch.bool)  # the cache, then each row's ancestors (row 0 the root)
    tree[:, :start] = True
    for i, parent in enumerate([-1, 0, 0, 1, 3]):
        tree[i, start + i] = True
        while parent >= 0:
            tree[i, start + parent], parent = True, [-1, 0, 0, 1, 3][parent]
    want = F.scaled_dot_product_attention(q.view(1, n, nh, hd).transpose(1, 2), kc[None, :, :start + n],
                                          vc[None, :, :start + n], attn_mask=tree, enable_gqa=True)
    _agree("attend", mod.attend(q, kc, vc, start, tree), want[0].transpose(0, 1).reshape(n, nh * hd),
           [mod.attend(q[i:i + 1], kc, vc, start + i, tree[i:i + 1]) for i in range(n)])
    _check_many(mod, g, nh, nkv, hd, tree)


def _check_many(mod, g: torch.Generator, nh: int, nkv: int, hd: int, tree: torch.Tensor) -> None:
    """rope_store_many and attend_many on two sequences in layer 1 of 2-layer caches (a tree of rows, then
    a chain of 2 after 6 cached): each sequence's bits what its own rope_store and attend calls give."""
    sizes, starts, masks = [tree.shape[0], 2], [tree.shape[1] - tree.shape[0], 6], [tree, None]
    qkv = torch.randn(sum(sizes), (nh + 2 * nkv) * hd, generator=g)
    ang = torch.rand(sum(sizes), hd // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1), torch.cat([-ang.sin(), ang.sin()], 1)
    ks, vs = ([torch.randn(2, 1, nkv, 10, hd, generator=g) for _ in sizes] for _ in "kv")
    alone = [(k[1, 0].clone(), v[1, 0].clone()) for k, v in zip(ks, vs)]
    got = mod.attend_many(mod.rope_store_many(qkv, cos, sin, ks, vs, 1, starts, sizes, nh, nkv), ks, vs, 1, starts,
                          sizes, masks)
    want, r = [], 0
    for (kc, vc), n, start, mask in zip(alone, sizes, starts, masks):
        q = mod.rope_store(qkv[r:r + n], cos[r:r + n], sin[r:r + n], kc, vc, start, nh, nkv)
        want.append(mod.attend(q, kc, vc, start, mask))
        r += n
    same_cache = all(torch.equal(k[1, 0], a) and torch.equal(v[1, 0], b) for k, v, (a, b) in zip(ks, vs, alone))
    if not (torch.equal(got, torch.cat(want)) and same_cache):
        raise RuntimeError("self-check failed: attend_many or rope_store_many differs from a call per sequence")


def _agree(op: str, got: torch.Tensor, want: torch.Tensor, rows: list[torch.Tensor]) -> None:
    if not torch.allclose(got, want, atol=1e-4):
        raise RuntimeError(f"self-check failed: {op} differs from torch's")
    if rows and not torch.equal(torch.cat(rows), got):
        raise RuntimeError(f"self-check failed: {op}'s rows depend on each other")


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
