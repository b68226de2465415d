"""The streaming linear kernel (runtime/stream.py): it builds here, computes the rounded-weight model at
every precision, gives every row the same bits whatever shares the call, and a machine that cannot
build it falls back, with one warning, to kernels computing the same model."""

import math
import platform
import sys
import types
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from specdec import sampling
from specdec.runtime import kernel_build, stream
from specdec.runtime.lean import LeanRunner
from specdec.runtime.packed import PRECISIONS, Linear, round_weight
from specdec.sampling import Coupling
from tests.helpers import at_threads, run, same_bits_on_any_thread_count, tiny_model

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not X86_AVX2, reason="the fused ops are part of the x86-64 kernel")

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them


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


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_row_has_the_same_bits_on_any_number_of_threads(precision):
    """Threads split a call's outputs, never a row's reduction (the rest of the suite runs mostly on one)."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(256, 1536, generator=g) / 40, torch.randn(256, generator=g)
    x = torch.randn(13, 1536, generator=g)
    lin = Linear(w, b, precision=precision)
    assert same_bits_on_any_thread_count(lin, x)


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


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension as ext

    def broken(*a, **k):
        raise RuntimeError("Error building extension 'x': g++: not found\nmore lines")

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setattr(stream, "PREBUILT", "specdec.runtime._not_installed")
    stream.kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="streaming linear kernel is unavailable.*g\\+\\+: not found"):
            assert stream.kernel() is None
        said = capsys.readouterr().err.splitlines()
        assert said == ["specdec: native kernels not built at install (none installed); building them now (needs g++)"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert stream.kernel() is None  # cached: no second warning, no second build
        assert Linear(torch.randn(8, 16)).stream is None
    finally:
        stream.kernel.cache_clear()


@needs_kernel
def test_the_module_built_at_install_serves_only_its_own_sources_and_machine(monkeypatch):
    """setup.py's module is used where its key is this build's; one built from other sources (an editable
    install edited since) or for another machine is not, nor is a missing one asked for twice."""
    real = stream.kernel()
    key = kernel_build.build_key(kernel_build.host_flags())
    name = "specdec.runtime._installed_test"
    monkeypatch.setattr(stream, "PREBUILT", name)
    assert stream._prebuilt(key) == (None, "none installed")
    # the build at first use stands in for itself: which module serves is the subject here, not compiling
    # (minutes on 2 cores; test_the_avx2_build_gives_the_avx512_builds_bits compiles)
    built = []
    monkeypatch.setattr(stream, "_jit", lambda key, flags, why: built.append(why) or real)
    try:
        for build_key, used in ((key, True), ("0" * 16, False)):
            installed = types.ModuleType(name)
            installed.__dict__.update({n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
            installed.__file__, installed.build_key = real.__file__, build_key
            monkeypatch.setitem(sys.modules, name, installed)
            stream.kernel.cache_clear()
            assert (stream.kernel() is installed) == used, build_key
            assert stream.kernel() is not None
        assert built == ["the installed build is of other sources or for another machine"]  # once, not per call
    finally:
        stream.kernel.cache_clear()


@needs_kernel
def test_the_self_check_runs_once_per_build(monkeypatch):
    """Passed once, a build is recorded (by its binary's digest) and not checked again by later
    processes; a failed check records nothing."""
    calls, check = [], stream._self_check
    monkeypatch.setattr(stream, "_self_check", lambda mod: calls.append(mod) or check(mod))
    mark = stream._check_mark(stream.kernel())
    try:
        mark.unlink()
        for _ in range(2):  # as two processes: each loads the kernel anew
            stream.kernel.cache_clear()
            assert stream.kernel() is not None
        assert len(calls) == 1 and mark.exists()
        mark.unlink()

        def fails(mod):
            raise RuntimeError("self-check failed: linear differs from torch's")

        monkeypatch.setattr(stream, "_self_check", fails)
        stream.kernel.cache_clear()
        with pytest.warns(UserWarning, match="self-check failed"):
            assert stream.kernel() is None
        assert not mark.exists()
    finally:
        stream.kernel.cache_clear()
        monkeypatch.setattr(stream, "_self_check", check)
        assert stream.kernel() is not None and mark.exists()  # recorded again for the tests after this one
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
        runner = LeanRunner(tiny_model("llama"))
        assert runner.decode_kernel in ("gemv", "packed")
        assert runner.kernel_path in ("onednn", "torch", "onednn+gemv", "torch+gemv")
    finally:
        stream.kernel.cache_clear()


@needs_kernel
def test_the_stats_say_which_kernels_ran(monkeypatch):
    from specdec.drafters.base import NoDrafter
    from specdec.sampling import SamplingParams

    runner = LeanRunner(tiny_model("llama"))
    assert runner.kernel_path == "stream+fused"  # every linear streams and the head size fits the fused ops
    _, stats = run(runner, NoDrafter(), [1, 2, 3], SamplingParams(), 3)
    assert stats.kernels == "stream+fused"
    monkeypatch.setenv("SPECDEC_STREAM", "0")
    stream.kernel.cache_clear()
    try:
        fallback = LeanRunner(tiny_model("llama"))
        _, stats = run(fallback, NoDrafter(), [1, 2, 3], SamplingParams(), 3)
        assert stats.kernels == fallback.kernel_path and not stats.kernels.startswith("stream")
    finally:
        stream.kernel.cache_clear()


class _Broken:
    """The real kernel module with one op broken: wrong values everywhere, or only when rows share a call."""

    def __init__(self, mod, op: str, how: str) -> None:
        self.mod, self.op, self.how = mod, op, how

    def __getattr__(self, name):
        real = getattr(self.mod, name)
        if name != self.op:
            return real

        def broken(*a, **k):
            y = real(*a, **k)
            if self.how == "values" or y.shape[0] > 1:
                y = y.clone()
                y[-1, 0] += 1e-2 if self.how == "values" else 1e-6
            return y
        return broken


@needs_kernel
@pytest.mark.parametrize("op", ["linear", "rms_norm", "silu_mul", "rope_store", "attend"])
@pytest.mark.parametrize("how", ["values", "rows"])
def test_the_self_check_catches_any_broken_op(op, how):
    if op == "rope_store" and how == "rows":
        pytest.skip("rope_store is checked on values only (it writes the cache: no one-row replay)")
    with pytest.raises(RuntimeError, match=f"self-check failed: {op}"):
        stream._self_check(_Broken(stream.kernel(), op, how))
    stream._self_check(stream.kernel())  # and the real module passes


# ---- the seeded uniforms (kernels/random.cpp) ----


@needs_kernel
@pytest.mark.parametrize("seed", [0, 5489, 2**32 + 3, 2**63 - 1, 2**64 - 1])
def test_the_kernels_uniforms_are_the_numpy_reference_bit_for_bit(seed):
    for n in (0, 1, 7, 1000, 49152, 151936):  # whole vocabularies too (SmolLM2, Qwen2.5)
        assert torch.equal(stream.kernel().uniform64(seed, n), sampling.uniform64(seed, n)), n


def test_the_seeded_uniforms_are_uniform_and_independent():
    """What the coupled draw's exactness rests on: each U uniform on [0, 1), no two seeds' or elements' alike."""
    a, b = sampling.uniform64(3, 200_000).numpy(), sampling.uniform64(4, 200_000).numpy()
    assert a.min() >= 0.0 and a.max() < 1.0
    assert scipy.stats.kstest(a, "uniform").pvalue > 1e-4
    assert scipy.stats.kstest(np.concatenate([a[::2], b[1::2]]), "uniform").pvalue > 1e-4
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.01 and abs(np.corrcoef(a, b)[0, 1]) < 0.01
    counts = np.histogram2d(a[:-1], a[1:], bins=8, range=[[0, 1], [0, 1]])[0].ravel()  # pairs of neighbours
    assert scipy.stats.chisquare(counts).pvalue > 1e-4


def _race_reference(p: torch.Tensor, u: torch.Tensor) -> int:
    """The first x of largest p[x] / -log(max(u[x], 1e-300)), every ratio computed."""
    r = [float(a) / -math.log(max(float(b), 1e-300)) for a, b in zip(p.double().tolist(), u.tolist())]
    return r.index(max(r))


@needs_kernel
def test_the_coupled_draw_is_the_same_with_and_without_the_kernels():
    """Coupling's uniforms and draw: the kernels' (uniform64, race) and torch's/numpy's give the same bits and
    tokens, and the draw is the exponential race with every ratio computed, ties to the first token."""
    g = torch.Generator().manual_seed(0)
    fast, slow = Coupling(11, 700, stream.kernel()), Coupling(11, 700)
    for i in range(300):
        u = fast.uniforms(i)
        assert torch.equal(u, slow.uniforms(i))
        kind = i % 5
        logits = torch.randn(700, generator=g) * (0.2 + 3 * (i % 7))
        p = torch.softmax(logits, -1)
        if kind == 1:
            p[torch.rand(700, generator=g) < 0.9] = 0.0  # top-k / top-p zeros
        elif kind == 2:
            p = torch.full((700,), 1 / 700)  # flat: every token a candidate
        elif kind == 3:
            p = torch.zeros(700)
            p[[5, 9]] = 0.5  # two equal maxima
        elif kind == 4:
            p = torch.zeros(700)
            p[699] = 1.0  # a point mass at the last token
        want = _race_reference(p, u)
        assert fast.pick(p, i) == slow.pick(p, i) == want, i
        assert p[want] > 0
    u = torch.zeros(700, dtype=torch.float64)  # U = 0 (clamped to 1e-300): an E of 690.8, never a division by 0
    p = torch.full((700,), 1 / 700)
    assert stream.kernel().race(p, u) == sampling.race(p, u) == _race_reference(p, u)


@needs_kernel
def test_the_self_check_catches_wrong_uniforms():
    class Shifted:
        def __init__(self, mod):
            self.mod = mod

        def __getattr__(self, name):
            return getattr(self.mod, name)

        def uniform64(self, seed, n):
            return self.mod.uniform64(seed + 1, n)

    with pytest.raises(RuntimeError, match="self-check failed: uniform64"):
        stream._self_check(Shifted(stream.kernel()))


# ---- the fused per-layer ops (kernels/fused.cpp) ----


def attention_reference(q, kc, vc, visible):
    """float64 softmax attention of q [n, nh*hd] over the cache rows visible[i] (bool [end]) per row."""
    n, nkv, hd = q.shape[0], kc.shape[0], kc.shape[2]
    nh = q.shape[1] // hd
    out = torch.empty(n, nh, hd, dtype=torch.float64)
    for i in range(n):
        cols = visible[i].nonzero().flatten()
        for h in range(nh):
            kh, vh = kc[h // (nh // nkv), cols].double(), vc[h // (nh // nkv), cols].double()
            p = torch.softmax(kh @ q[i, h * hd:(h + 1) * hd].double() / hd ** 0.5, 0)
            out[i, h] = p @ vh
    return out.view(n, -1).float()


@needs_kernel
@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
@pytest.mark.parametrize("hd,start", [(16, 37), (64, 37), (128, 37), (256, 37), (64, 301)])
def test_fused_attention_is_softmax_attention_over_exactly_each_rows_columns(hd, start, cache):
    """Each row over exactly its columns, and the same bits alone as beside other rows: the rows of one
    call share the K/V blocks of the columns all of them see (start 301: several blocks), never arithmetic.
    An fp16 cache is read as its values widened (exactly) to fp32."""
    ops = stream.kernel()
    g = torch.Generator().manual_seed(hd + start)
    nh, nkv, n = 6, 2, 9
    cap = start + n + 8
    kc, vc = torch.randn(nkv, cap, hd, generator=g).to(cache), torch.randn(nkv, cap, hd, generator=g).to(cache)
    q = torch.randn(n, nh * hd, generator=g) * 3
    arbitrary = torch.rand(n, start + n, generator=g) < 0.6  # any visibility pattern, every row sees itself
    arbitrary[:, :start] |= torch.arange(start) < 5
    arbitrary[torch.arange(n), start + torch.arange(n)] = True
    tree = torch.zeros(n, start + n, dtype=torch.bool)  # a draft tree: the cache, then the row's ancestors
    tree[:, :start] = True
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    for i in range(n):
        j = i
        while j >= 0:
            tree[i, start + j], j = True, parents[j]
    chain = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    for mask, visible in ((arbitrary, arbitrary), (tree, tree), (None, chain)):
        out = ops.attend(q, kc, vc, start, mask)
        ref = attention_reference(q, kc.float(), vc.float(), visible)
        assert (out - ref).abs().max() < 1e-5
        for i in range(n):  # each row alone, and with other columns added to the cache: the same bits
            row_mask = visible[i:i + 1].clone()
            assert torch.equal(ops.attend(q[i:i + 1], kc, vc, start + i, row_mask), out[i:i + 1])
            wider = torch.cat([row_mask, torch.zeros(1, 7, dtype=torch.bool)], 1)
            assert torch.equal(ops.attend(q[i:i + 1], kc, vc, 0, wider), out[i:i + 1])


@needs_kernel
@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
def test_packed_sequences_get_the_bits_of_their_own_rope_and_attention_calls(cache):
    """rope_store_many and attend_many over sequences of 1, 8 and 64 rows (a chain, a tree, an arbitrary
    mask; different cache lengths), each in layer 2 of its own cache: every sequence's q, cache writes and
    attention output equal its own rope_store and attend calls, to the bit. An fp16 cache holds what an fp32
    one holds, rounded to nearest even (torch's .half())."""
    ops = stream.kernel()
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, layers = 6, 2, 64, 3
    sizes, starts = [1, 8, 64], [40, 301, 5]
    masks = [None]
    tree = torch.zeros(8, 309, dtype=torch.bool)
    tree[:, :301] = True
    tree[torch.arange(8), 301 + torch.arange(8)] = True
    tree[1:, 301] = True  # every row below the root
    masks.append(tree)
    arbitrary = torch.rand(64, 69, generator=g) < 0.5
    arbitrary[torch.arange(64), 5 + torch.arange(64)] = True
    masks.append(arbitrary)
    qkv = torch.randn(sum(sizes), (nh + 2 * nkv) * hd, generator=g)
    ang = torch.rand(sum(sizes), hd // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1), torch.cat([-ang.sin(), ang.sin()], 1)
    ks = [torch.randn(layers, 1, nkv, 400, hd, generator=g).to(cache) for _ in sizes]
    vs = [torch.randn(layers, 1, nkv, 400, hd, generator=g).to(cache) for _ in sizes]
    alone = [(k[2, 0].clone(), v[2, 0].clone()) for k, v in zip(ks, vs)]
    other_layers = [k[:2].clone() for k in ks]
    q = ops.rope_store_many(qkv, cos, sin, ks, vs, 2, starts, sizes, nh, nkv)
    out = ops.attend_many(q, ks, vs, 2, starts, sizes, masks)
    r = 0
    for s, ((kc, vc), n, start, mask) in enumerate(zip(alone, sizes, starts, masks)):
        rows = slice(r, r + n)
        q1 = ops.rope_store(qkv[rows], cos[rows], sin[rows], kc, vc, start, nh, nkv)
        assert torch.equal(q[rows], q1), s
        assert torch.equal(ks[s][2, 0], kc) and torch.equal(vs[s][2, 0], vc), s
        assert torch.equal(out[rows], ops.attend(q1, kc, vc, start, mask)), s
        assert torch.equal(ks[s][:2], other_layers[s]), s  # only the given layer is written
        if cache == torch.float16:
            k32, v32 = kc.float(), vc.float()
            ops.rope_store(qkv[rows], cos[rows], sin[rows], k32, v32, start, nh, nkv)
            assert torch.equal(k32.half(), kc) and torch.equal(v32.half(), vc), s
        r += n
    with pytest.raises(RuntimeError, match="one cache, start, size and mask per sequence"):
        ops.attend_many(q, ks, vs, 2, starts, sizes, masks[:2])


@needs_kernel
def test_fused_elementwise_ops_match_torch():
    ops = stream.kernel()
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 96, generator=g) * 4, torch.randn(96, generator=g)
    x[3] *= 1e3
    ref = F.rms_norm(x.double(), (96,), w.double(), 1e-5).float()
    y = ops.rms_norm(x, w, 1e-5)
    assert ((y - ref).abs() / ref.abs().clamp(min=1e-3)).max() < 1e-5
    assert torch.equal(torch.cat([ops.rms_norm(x[i:i + 1], w, 1e-5) for i in range(11)]), y)
    gu = torch.randn(5, 2 * 64, generator=g) * 30  # exp far into both tails
    gate, up = gu.double().chunk(2, -1)
    ref = (F.silu(gate) * up).float()
    assert ((ops.silu_mul(gu) - ref).abs() / ref.abs().clamp(min=1e-6)).max() < 1e-5


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_fused_layer_computes_the_torch_layer(family):
    """llama.Block on the fused kernels against its own torch ops with the same linears: prefill (SDPA),
    decode, a chain and a tree (row by row), the same output and the same K/V written."""
    from specdec.runtime.kv import KVCache
    from specdec.runtime.llama import Block, Rope

    model = tiny_model(family)
    layer, cfg = model.model.layers[1], model.config
    block = Block(layer, 0, cfg.rms_norm_eps)
    assert block.fused is not None
    ops = block.fused
    rope = Rope(model.model.rotary_emb, torch.device("cpu"), torch.float32, 64)
    rope.grow(64)
    caches = [KVCache(1, block.n_kv, block.head_dim, 64, "cpu", torch.float32, 64) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [(0, 20, None, True), (20, 1, None, False), (21, 3, "chain", False), (24, 4, tree, False)]
    for start, n, mask, causal in steps:
        if isinstance(mask, torch.Tensor):
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool), mask], 1)
        elif mask == "chain":
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        h = torch.randn(1, n, cfg.hidden_size, generator=g)
        pos = torch.arange(start, start + n)
        cos, sin = rope(pos)
        rows = True if n <= 8 else None
        outs = []
        for kv, fused in zip(caches, (ops, None)):
            block.fused = fused
            outs.append(block(h, cos, sin, kv, start, mask, causal, rows))
        block.fused = ops
        assert (outs[0] - outs[1]).abs().max() < 1e-5, (start, n)
        end = start + n
        assert torch.allclose(caches[0].k[..., :end, :], caches[1].k[..., :end, :], atol=1e-6)
        assert torch.allclose(caches[0].v[..., :end, :], caches[1].v[..., :end, :], atol=1e-6)
