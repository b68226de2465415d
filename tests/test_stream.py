"""The streaming linear kernel (target/stream.py): it builds here, computes the rounded-weight model at
every precision, gives every row the same bits whatever shares the call, and a machine that cannot
build it falls back, with one warning, to kernels computing the same model."""

import platform
import warnings

import pytest
import torch
import torch.nn.functional as F

from specdec.target import stream
from specdec.target.lean import LeanRunner
from specdec.target.packed import PRECISIONS, Linear, round_weight
from tests.conftest import tiny_model

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512")


def reference(x, w, b, precision):
    stored, scale = round_weight(w, precision)
    y = F.linear(x.double(), stored.double())
    if scale is not None:
        y = y * scale.double()
    return (y + b.double()).float()


@pytest.mark.skipif(not X86_AVX2, reason="the kernel is x86-64 AVX2 code; other machines use the fallback")
def test_the_kernel_builds_on_this_machine():
    """CI's machine has a compiler (the Makefile installs one): a failed build must fail here, not only
    slow every decode step down."""
    assert stream.kernel() is not None
    assert LeanRunner(tiny_model("llama")).decode_kernel == "stream"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("k", [70, 64, 1536])  # k % 8 != 0, a multiple of 32, a long reduction
def test_every_row_count_gives_each_row_the_same_bits_and_the_rounded_model(precision, k):
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(37, k, generator=g) / k ** 0.5, torch.randn(37, generator=g)
    x = torch.randn(20, k, generator=g)
    lin = Linear(w, b, precision=precision)
    assert lin.stream is not None or not X86_AVX2
    alone = torch.cat([lin(x[i:i + 1]) for i in range(20)])
    for n in (2, 3, 5, 6, 7, 12, 13, 20):  # around the kernel's 6-row blocks
        assert torch.equal(lin(x[:n]), alone[:n]), n
    assert torch.equal(lin(x.view(4, 5, k)).view(20, -1), alone)  # batched shapes are rows too
    ref = reference(x, w, b, precision)
    assert (alone - ref).abs().max() < 1e-4 * ref.abs().max()


def test_reduced_precisions_round_only_the_weights():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 96, generator=g), torch.randn(48, generator=g), torch.randn(9, 96, generator=g)
    x[3] *= 1000  # an outlier row changes nothing for the others: activations are never quantized
    for p in ("bf16", "fp16", "int8"):
        y = Linear(w, b, precision=p)(x)
        assert torch.equal(Linear(w, b, precision=p)(x[[0, 1, 2, 4]]), y[[0, 1, 2, 4]])
        assert not torch.equal(y, Linear(w, b)(x))  # a different model...
        assert ((y - x @ w.T - b).norm(dim=1) / (x @ w.T + b).norm(dim=1)).max() < 0.02  # ...and a close one


@pytest.mark.parametrize("precision", PRECISIONS)
def test_without_the_kernel_the_fallback_computes_the_same_model(monkeypatch, precision):
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(40, 1536, generator=g) / 40, torch.randn(40, generator=g), torch.randn(8, 1536, generator=g)
    fast = Linear(w, b, precision=precision)
    monkeypatch.setattr(stream, "kernel", lambda: None)
    slow = Linear(w, b, precision=precision)
    assert slow.stream is None and slow.invariant
    assert torch.allclose(slow(x), fast(x), atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cat([slow(x[i:i + 1]) for i in range(8)]), slow(x))


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext

    def broken(*a, **k):
        raise RuntimeError("Error building extension 'x': g++: not found\nmore lines")

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ext, "load", broken)
    stream.kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="streaming linear kernel is unavailable.*g\\+\\+: not found"):
            assert stream.kernel() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert stream.kernel() is None  # cached: no second warning, no second build
        assert Linear(torch.randn(8, 16)).stream is None
    finally:
        stream.kernel.cache_clear()


def test_runners_built_from_several_threads_share_one_kernel():
    from concurrent.futures import ThreadPoolExecutor

    stream.kernel.cache_clear()
    with ThreadPoolExecutor(4) as pool:
        mods = list(pool.map(lambda _: stream.kernel(), range(4)))
    assert all(m is mods[0] for m in mods)


def test_a_bad_switch_is_one_clear_error(monkeypatch):
    from specdec.errors import SpecdecError

    monkeypatch.setenv("SPECDEC_STREAM", "off")
    stream.kernel.cache_clear()
    try:
        with pytest.raises(SpecdecError, match="SPECDEC_STREAM must be 0 .* or 1"):
            stream.kernel()
    finally:
        stream.kernel.cache_clear()


def test_it_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_STREAM", "0")
    stream.kernel.cache_clear()
    try:
        assert stream.kernel() is None
        assert LeanRunner(tiny_model("llama")).decode_kernel in ("gemv", "packed")
    finally:
        stream.kernel.cache_clear()
