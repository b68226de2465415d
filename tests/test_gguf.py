"""GGUF files on their own quantized weights (runtime/gguf.py, kernels/quant.cpp): every format the kernel
reads matches its de-quantized reference, every row of a forward is bit-identical to that row alone (N =
1, 8, 64), so speculative decoding equals vanilla exactly (greedy) and keeps the target's distribution
(chi-square) on each format; loading never builds a float copy of the weights."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdec.bench.runner import _model_info
from specdec.drafters import registry
from specdec.drafters.draft_model import DraftModelDrafter, draft_runner
from specdec.errors import SpecdecError
from specdec.runtime import stream
from specdec.runtime.gguf import (
    X16_TYPES,
    GGUFModel,
    QuantTensor,
    QuantWeight,
    _Rotary,
    _rotary,
    requantized,
)
from specdec.runtime.gguf_header import hf_config, read_header
from specdec.runtime.lean import LeanRunner
from specdec.runtime.loading import Runtime, gguf_meta
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from tests import background
from tests.helpers import (
    FORMATS,
    K_QUANTS,
    SMALL_V,
    assert_tree_rows_are_steps,
    at_threads,
    chi2_pvalue,
    gguf_runner,
    greedy_taus,
    random_blocks,
    runner_first3,
    same_bits_on_any_thread_count,
    sample_first3,
    synthetic_gguf,
    tiny_gguf,
    tiny_model,
)

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them

pytestmark = pytest.mark.skipif(stream.kernel() is None, reason="needs the streaming kernels (x86-64, AVX2)")


def qtensor(fmt, rows, k, seed=0):
    qt = GGMLQuantizationType[fmt]
    blocks = random_blocks(qt, rows, k, np.random.default_rng(seed))
    return QuantTensor(torch.from_numpy(blocks), int(qt), k), dequantize(blocks, qt).astype(np.float64)


def act_quantized(x: np.ndarray, block: int) -> np.ndarray:
    """The activations as the kernel sees them: int8 codes per block of `block`, scale max|x| / 127."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * (amax / np.float32(127))).reshape(x.shape)


@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_matches_its_dequantized_reference(fmt, rows):
    """40 rows: the file's layout; 48: the x16 formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) re-laid, values kept."""
    k = 512 if fmt in K_QUANTS else 352  # 11 blocks of 32: not a whole group of 8
    w, ref_w = qtensor(fmt, rows, k)
    blocks = w.data.clone()
    assert np.array_equal(w.dequantize().numpy(), ref_w.astype(np.float32))  # the gguf package's own decoding
    x = np.random.default_rng(1).standard_normal((9, k)).astype(np.float32)
    x[4] *= 1000  # an outlier row must not coarsen the other rows' quantization
    lin = QuantWeight([w], None)
    assert w.x16 == (rows == 48 and fmt in X16_TYPES)
    assert np.array_equal(w.dequantize().numpy(), ref_w.astype(np.float32))  # re-laid: the same values
    ids = torch.tensor([0, 5, 17, 18, rows - 1])
    assert torch.equal(w.take_rows(ids).data, blocks[ids])  # rows taken back out: the file's bytes
    y = lin(torch.from_numpy(x)).numpy()
    ref = act_quantized(x, w.family).astype(np.float64) @ ref_w.T
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
    assert np.abs(y - x @ ref_w.T).max() / np.abs(ref).max() < 0.05  # and close to the float product


# where each format's codes lie in its block (bytes from, to) and the fifth bits of Q5_0
CODES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (6, 22), "Q4_K": (16, 144), "Q6_K": (0, 192)}


@pytest.mark.parametrize("fmt", list(CODES))
def test_the_largest_codes_against_the_largest_activations_sum_exactly(fmt):
    """Without VNNI the x16 kernels add several steps' products in int16 before widening (and K-quants scale
    them on the widening multiply-add): with every code at its largest (15; Q5_0's 31, Q6_K's 63) and every
    activation at +-127 the sums must still be exact, in passes of one, two and three rows."""
    qt = GGMLQuantizationType[fmt]
    k = 512
    blocks = random_blocks(qt, 48, k, np.random.default_rng(3)).reshape(48, k // GGML_QUANT_SIZES[qt][0], -1)
    lo, hi = CODES[fmt]
    blocks[..., lo:hi] = 0xFF
    if fmt == "Q5_0":
        blocks[..., 2:6] = 0xFF
    blocks = np.ascontiguousarray(blocks.reshape(48, -1))
    w = QuantTensor(torch.from_numpy(blocks), int(qt), k)
    ref_w = dequantize(blocks, qt).astype(np.float64)
    x = np.where(np.arange(k) % 64 < 32, 1.0, -1.0)[None].repeat(3, 0).astype(np.float32)
    x[1] = 1.0  # every activation +127 ...
    x[2] = -1.0  # ... or -127
    ref = x.astype(np.float64) @ ref_w.T
    for n in (1, 2, 3):
        y = QuantWeight([w], None)(torch.from_numpy(x[:n])).numpy()
        assert np.abs(y - ref[:n]).max() <= 1e-5 * np.abs(ref[:n]).max(), n


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_is_bit_identical_to_that_row_alone(fmt):
    """N = 1..16 and 64 rows (every tile size and remainder of the kernels' passes), with bias and residual,
    and fused parts of other formats of the same family."""
    other = {"Q4_0": "Q8_0", "Q4_1": "Q5_0", "Q5_0": "Q4_1", "Q5_1": "Q8_0", "Q8_0": "Q4_0",
             "Q4_K": "Q6_K", "Q5_K": "Q4_K", "Q6_K": "Q5_K"}[fmt]
    k = 512 if fmt in K_QUANTS else 352
    parts = [qtensor(fmt, 48, k, 0)[0], qtensor(other, 16, k, 1)[0], qtensor(fmt, 37, k, 2)[0]]
    g = torch.Generator().manual_seed(0)
    lin = QuantWeight(parts, torch.randn(101, generator=g))
    x, res = torch.randn(64, k, generator=g), torch.randn(64, 101, generator=g)
    alone = torch.cat([lin(x[i:i + 1], res[i:i + 1]) for i in range(64)])
    for n in (*range(1, 17), 64):
        assert torch.equal(lin(x[:n], res[:n]), alone[:n]), n
    mixed = QuantWeight([qtensor("Q4_K", 16, 512)[0], qtensor("Q8_0", 16, 512)[0]], None)  # two kernel calls
    x = torch.randn(8, 512, generator=g)
    assert torch.equal(torch.cat([mixed(x[i:i + 1]) for i in range(8)]), mixed(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_has_the_same_bits_on_any_number_of_threads(fmt):
    """Threads split a call's outputs, never a row's reduction: the bits follow neither the thread count nor
    how many rows share the call (the rest of the suite runs mostly on one thread)."""
    k = 512 if fmt in K_QUANTS else 352
    g = torch.Generator().manual_seed(0)
    lin = QuantWeight([qtensor(fmt, 256, k, 0)[0]], torch.randn(256, generator=g))
    x = torch.randn(13, k, generator=g)
    assert same_bits_on_any_thread_count(lin, x)


@pytest.fixture(scope="module", params=FORMATS)
def tiny(request, tmp_path_factory):
    path, model = tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", request.param, "llama")
    return request.param, path, model


def test_the_file_decodes_as_the_dequantized_model_does(tiny, tmp_path):
    """Loading reads every tensor where llama.cpp's layout put it (llama's interleaved q/k rows
    included): logits within activation-quantization error of the float model on the same weights."""
    _, path, model = tiny
    ids = torch.arange(3, 40)
    got = gguf_runner(path, model).forward(ids).logits
    ref = LeanRunner(model).forward(ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 0.03
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    qwen_path, qwen = tiny_gguf(tmp_path / "q.gguf", "Q4_K", "qwen2", seed=3)  # no interleave, q/k/v biases
    got, ref = gguf_runner(qwen_path, qwen).forward(ids).logits, LeanRunner(qwen).forward(ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


def test_a_tree_row_equals_decoding_its_path_bitwise(tiny):
    _, path, model = tiny
    assert_tree_rows_are_steps(lambda: gguf_runner(path, model))


def test_the_kv_cache_is_fp16_and_a_long_forward_reads_it_too(tiny):
    """A GGUF target keeps K and V in fp16 (llama.cpp's default); a forward past the exact rows (one SDPA call
    over the cache) reads the same values as the exact forwards do."""
    _, path, model = tiny
    r = gguf_runner(path, model)
    assert r.cache.k.dtype == torch.float16 and LeanRunner(model).cache.k.dtype == torch.float32
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(0))
    whole = r.forward(ids).logits[-1]
    r.reset()
    for i in range(0, 100, 50):
        last = r.forward(ids[i:i + 50]).logits[-1]
        r.commit(range(50))
    assert ((whole - last).norm() / last.norm()).item() < 0.02  # activation rounding: as with an fp32 cache


def test_the_layers_in_one_native_call_give_the_layer_loops_bits(tiny, tmp_path):
    """llama.native_stack: a forward's layers in one native call. Every row's logits, features and aux-layer
    states equal the layer-by-layer path's, at N = 1...64 rows (chains and trees), on each format, on Qwen2's
    biased q/k/v, and on an EAGLE head over the file's blocks."""
    from specdec.heads.model import EagleHead
    from specdec.heads.runner import runner_for
    from specdec.runtime.base import tree_mask
    from specdec.tree import DraftTree

    fmt, path, model = tiny
    qwen_path, qwen = tiny_gguf(tmp_path / "q.gguf", "Q4_K", "qwen2", seed=3)
    g = torch.Generator().manual_seed(0)
    for r in (gguf_runner(path, model), gguf_runner(qwen_path, qwen)):
        assert r.stack is not None
        stack, prompt = r.stack, torch.randint(0, 97, (9,), generator=g)
        for n in (1, 2, 3, 5, 8, 13, 16, 31, 64):
            toks = torch.randint(0, 97, (n,), generator=g)
            # a root and a random tree of n - 1 nodes under it
            parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n - 1)]
            tree = DraftTree(toks[1:], torch.tensor(parents, dtype=torch.long))
            depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
            for positions, mask in ((None, None), (9 + depth, tree_mask(9, tree.ancestor_mask()))):
                outs = []
                for native in (stack, None):
                    r.stack = native
                    r.reset()
                    r.forward(prompt)
                    r.commit(range(9))
                    outs.append(r.forward(toks, positions, mask, aux_layers=(0, 1)))
                a, b = outs
                assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features), (fmt, n)
                assert torch.equal(a.aux, b.aux), (fmt, n)
        # several sequences packed in one forward (forward_many: a batch's step), each after its own prompt
        forks = [r.fork() for _ in range(3)]
        outs = []
        for native in (stack, None):
            for f in forks:
                f.stack = native
                f.reset()
                f.forward(prompt[: 5 + forks.index(f)])
                f.commit(range(5 + forks.index(f)))
            parts = [(f, torch.arange(3, 3 + n), None, None) for f, n in zip(forks, (1, 4, 7))]
            outs.append(forks[0].forward_many(parts, aux_layers=(1,)))
        for a, b in zip(*outs):
            assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux), fmt
        r.stack = stack
    head = EagleHead(model.config).eval()
    run = runner_for(head, model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach(),
                     weights="q8_0")
    assert run.stack is not None
    feats = torch.randn(20, model.config.hidden_size, generator=g)
    outs = []
    for native in (run.stack, None):
        run.stack = native
        run.reset()
        got = [run.forward(torch.arange(3, 11), feats[:8])]
        run.commit(range(8))
        got.append(run.forward(torch.arange(11, 23), feats[8:], draft=False))
        outs.append(got)
    forks = [run.fork() for _ in range(2)]
    for native in (run.stack, None):
        for f in forks:
            f.stack = native
            f.reset()
        outs.append(run.forward_many([(f, torch.arange(3, 3 + n), feats[:n], None, None)
                                      for f, n in zip(forks, (2, 5))]))
    for (fa, ga), (fb, gb) in zip(outs[0] + outs[2], outs[1] + outs[3]):
        assert torch.equal(fa, fb) and torch.equal(ga, gb)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculative_greedy_equals_vanilla_exactly(tiny, shape):
    _, path, model = tiny
    target = gguf_runner(path, model)
    # the float model on the same weights drafts: close to the target, not equal to it
    drafter = DraftModelDrafter(LeanRunner(model), target.vocab_size, 4,
                                TreeBudget(4, 3, 10) if shape == "tree" else None)
    taus = greedy_taus(target, drafter, n=32)
    assert np.mean(taus) > 1.5


@pytest.mark.usefixtures("on_one_thread")
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
def test_sampling_keeps_the_gguf_targets_distribution(fmt, tmp_path):
    """One format of each kernel family and a chain: what a format could change, a row's bits beside other
    rows and a tree row's against its path, every format's tests above check bit for bit."""
    path, model = tiny_gguf(tmp_path / "t.gguf", fmt, "llama", seed=5, vocab_size=SMALL_V, head_scale=1.5)
    target = gguf_runner(path, model)
    shape_tree = fmt in ("Q4_K", "Q4_0")  # a tree for one format of each family, a chain for Q8_0
    drafter = DraftModelDrafter(LeanRunner(model), SMALL_V, 3, TreeBudget(3, 2, 5) if shape_tree else None)
    params = SamplingParams(0.9, top_k=4, top_p=0.95)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params, n=1500)
    assert max(sizes) >= 3
    exp = runner_first3(target, prompt, params, SMALL_V)
    assert (exp > 0.01).sum() >= 8  # a distribution worth testing, not a point mass
    assert chi2_pvalue(counts, exp) > 1e-3


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensor_table_is_what_the_gguf_reader_lists(tmp_path, alignment):
    """read_header reads the header alone, past every kind of metadata value (strings, scalars, arrays of
    strings and of numbers, a nested array): the scalars' values, and each tensor's name, type, dims,
    offset, bytes and data are GGUFReader's."""
    from gguf import GGUFReader, GGUFWriter

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("x.text", "héllo")
    w.add_array("x.words", ["a", "", "ünïcode", "x" * 300])
    w.add_array("x.ints", list(range(7)))
    w.add_array("x.floats", [0.5, -1.0])
    w.add_array("x.nested", [[1, 2], [3]])
    w.add_bool("x.flag", True)
    w.add_float64("x.f64", 2.5)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    for name, kind in (("q4k", GGMLQuantizationType.Q4_K), ("q8", GGMLQuantizationType.Q8_0)):
        blocks = random_blocks(kind, 4, 256, rng, 1.0)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = GGUFReader(str(tmp_path / "t.gguf")).tensors
    meta, got = read_header(tmp_path / "t.gguf")
    assert meta["x.text"] == "héllo" and meta["x.flag"] is True and meta["x.f64"] == 2.5
    assert meta["general.architecture"] == "llama" and "x.words" not in meta
    assert meta.get("general.alignment") == alignment
    assert [t.name for t in got] == ["f32", "f16", "q4k", "q8"] == [t.name for t in want]
    for a, b in zip(got, want):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                          b.data_offset)
        assert a.shape.tolist() == b.shape.tolist() and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)


def test_weights_gguf_is_checked_before_anything_loads(tmp_path):
    from specdec.runtime.loading import native_gguf

    hf_dir = tmp_path / "m"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="weights=gguf needs a .gguf file"):
        native_gguf(hf_dir, "cpu", "gguf")
    assert not native_gguf(hf_dir, "cpu", None)
    assert native_gguf("smollm2", "cpu", None)  # a .gguf on the CPU: its own weights by default
    assert not native_gguf("smollm2", "cpu", "int8")


RSS_SCRIPT = """
import json, resource, sys, torch
from transformers import LlamaConfig
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.lean import LeanRunner
cfg = LlamaConfig(**json.loads(sys.argv[2]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = LeanRunner(GGUFModel(sys.argv[1], cfg), weights="gguf", initial_capacity=64)
r.forward(torch.arange(8))
print(json.dumps({"base_kb": base, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family,rope", [("llama", None), ("qwen2", None), ("mistral", None), ("gemma3", None),
                                         ("llama", LLAMA3), ("llama", {"rope_type": "linear", "rope_theta": 1e4,
                                                                       "factor": 2.0})])
def test_rope_tables_are_the_model_familys_bit_for_bit(family, rope):
    """A GGUF model's rotary tables, made without the family's model code, equal transformers' own module's
    (Gemma 3: each layer type's, its global layers' linear scaling included), position by position."""
    model = tiny_model(family, **({} if rope is None else {"rope_parameters": rope}))
    cfg = model.config
    ours, theirs = _rotary(cfg), model.get_decoder().rotary_emb
    assert isinstance(ours, _Rotary)
    x, pos = torch.empty(0), torch.arange(700)[None]  # past original_max_position_embeddings and the window
    for kind in (sorted(set(cfg.layer_types)) if family == "gemma3" else [None]):
        args = () if kind is None else (kind,)
        (c1, s1), (c2, s2) = ours(x, pos, *args), theirs(x, pos, *args)
        assert torch.equal(c1, c2) and torch.equal(s1, s2), kind


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_config_and_tokenizer_read_from_the_header_are_transformers_own(family, tmp_path, monkeypatch):
    """gguf_meta builds them without transformers' GGUF loader: the same files as AutoConfig's and
    AutoTokenizer's from the same file."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, _ = tiny_gguf(tmp_path / "m.gguf", "Q8_0", family, tokenizer=True)
    assert hf_config(path) == load_gguf_checkpoint(str(path))["config"]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    ours = gguf_meta(path)
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name).save_pretrained(tmp_path / "ref")
    cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    cfg.pop("quantization_config", None)
    assert json.loads((ours / "config.json").read_text()) == json.loads(json.dumps(cfg))
    files = sorted(f.name for f in (tmp_path / "ref").iterdir())
    assert "tokenizer.json" in files and all((ours / f).read_bytes() == (tmp_path / "ref" / f).read_bytes()
                                             for f in files)


def test_a_gguf_model_loads_without_transformers_model_code(smollm2_tokenizer_dir):
    """Its rotary tables were the one reason to import it: ~130 MB of a process's memory and ~1.6 s."""
    code = ("import sys; from specdec.runtime.loading import load_model; load_model('smollm2'); "
            "print(sorted(m for m in sys.modules if '.models.' in m and '.modeling_' in m and 'auto' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.slow
def test_loading_maps_the_file_and_builds_no_float_copy(tmp_path):
    """Peak memory grows by about the file's size, not the 7x of an fp32 copy."""
    kw = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)
    path = synthetic_gguf(tmp_path / "big.gguf", kw, "Q4_K")
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path), json.dumps(kw)], capture_output=True,
                         text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (m["peak_kb"] - m["base_kb"]) * 1024
    assert grown < 1.3 * size + 60e6, (grown, size)  # fp32 weights would be ~7 x size


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="compares the AVX-512 build")
def test_the_avx2_build_gives_the_avx512_builds_bits():
    """The kernel's AVX2 code (two accumulators, one block at a time; x16: 8 outputs a vector) does per lane
    what its AVX-512 code does (two blocks per vector; x16: 16 outputs): a model gives the same bits on
    either kind of machine."""

    avx2 = background.avx2_kernels()  # its build started with the session (conftest)
    g = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        k = 512 if fmt in K_QUANTS else 352
        for rows in (40, 48):  # 48: the x16 kernel where the format has it
            lin = QuantWeight([qtensor(fmt, rows, k)[0]], None)
            ws, ts, key = lin.groups[0]
            for n in (1, 2, 3, 5, 7, 8, 11):
                x = torch.randn(n, k, generator=g)
                assert torch.equal(getattr(avx2, lin.parts[0].op)(x, ws, ts, None, None),
                                   lin.call(key)(x, ws, ts, None, None)), (fmt, rows, n)
    for n in (1, 625, 49152):  # the seeded uniforms of sampling.Coupling
        assert torch.equal(avx2.uniform64(7, n), stream.kernel().uniform64(7, n))
        p = torch.softmax(torch.randn(n, generator=g) * 2, -1)
        assert avx2.race(p, avx2.uniform64(7, n)) == stream.kernel().race(p, avx2.uniform64(7, n))


def test_the_bench_reports_a_gguf_targets_parameters_and_block_types(tmp_path):
    path, model = tiny_gguf(tmp_path / "t.gguf", "Q4_1", "llama")
    info = _model_info(GGUFModel(path, model.config), None)
    # every tensor of the file, not only the float ones (the norms) its parameters() yields
    assert info["parameters"] >= sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    assert info["dtype"].startswith("GGUF blocks (Q4_1")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K", "Q5_0"])
def test_a_requantized_matrix_is_the_new_formats_blocks_of_its_values(fmt):
    qt, _ = qtensor(fmt, 32, 256, seed=4)
    want = quantize(qt.dequantize().numpy(), GGMLQuantizationType.Q4_0)
    qt.interleave()  # a weight the kernel already reads re-laid: its values, in the file's layout again
    other, _ = qtensor("Q4_K", 16, 256, seed=5)
    q4, q4_other = requantized([qt, other], int(GGMLQuantizationType.Q4_0))
    assert q4.type_name == "Q4_0" and q4.shape == qt.shape and not q4.x16
    assert np.array_equal(q4.data.numpy(), want)
    assert np.array_equal(q4_other.data.numpy(), quantize(other.dequantize().numpy(), GGMLQuantizationType.Q4_0))


def test_a_draft_requantized_to_q4_0_keeps_greedy_equal_to_vanilla(tmp_path):
    path, model = tiny_gguf(tmp_path / "t.gguf", "Q8_0", "llama", seed=2)
    target = gguf_runner(path, model)
    draft = registry.Target(None, target, None, GGUFModel(path, model.config), None, Runtime(weights="gguf"))
    runner = draft_runner(draft, 0, "q4_0")
    kinds = {p.type_name for b in runner.layers for x in (b.qkv, b.o, b.gate_up, b.down) for p in x.stream.parts}
    assert kinds == {"Q4_0"} and runner.requantized_to == "Q4_0"
    assert {p.type_name for p in runner.lm_head.stream.parts} == {"Q4_0"}
    assert {p.type_name for p in draft_runner(draft, 0, "file").lm_head.stream.parts} == {"Q8_0"}
    taus = greedy_taus(target, DraftModelDrafter(runner, target.vocab_size, 4), n=32)
    assert np.mean(taus) > 1.5  # the same model in coarser blocks: close to the target, not equal to it


def test_a_float_runner_keeps_its_weights_when_asked_to_requantize():
    runner = LeanRunner(tiny_model("llama"))
    assert not runner.requantize(int(GGMLQuantizationType.Q4_0)) and runner.requantized_to is None
