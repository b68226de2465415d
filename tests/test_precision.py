"""Weight precisions (fp32, bf16, fp16, int8): every row of a forward is bit-identical to the same row
computed alone, so speculative decoding equals vanilla decoding *exactly* at each precision (greedy:
the same tokens, no tie allowance; sampling: that precision's own distribution)."""

import json

import numpy as np
import pytest
import torch

from specdec.drafters.base import NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import SpecdecError
from specdec.runtime.base import tree_mask
from specdec.runtime.lean import LeanRunner
from specdec.runtime.loading import Runtime, make_runner
from specdec.runtime.packed import Linear, invariant_block
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeBudget
from tests.helpers import (
    PROMPTS,
    at_threads,
    char_tokenizer,
    chi2_pvalue,
    flat_tiny,
    noisy_copy,
    run,
    runner_first3,
    sample_first3,
    tiny_model,
)

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them

PRECISIONS = ["fp32", "bf16", "fp16", "int8", "int4"]


def long_model(family="llama", seed=0, **kw):
    """The down projection reduces over 1536 > 1024 inputs: long enough that oneDNN's GEMM is not
    batch-invariant in one piece on some machines, so the blocked path is exercised there."""
    return tiny_model(family, seed=seed, intermediate_size=1536, **kw)


def prefilled(model, weights, prompt):
    r = LeanRunner(model, weights=weights, exact=True)
    r.forward(torch.tensor(prompt))
    r.commit(range(len(prompt)))
    return r


@pytest.mark.parametrize("weights", PRECISIONS)
def test_a_chain_forward_equals_one_token_steps_bitwise(family, weights):
    model = long_model(family)
    prompt, cont = list(range(3, 30)), [5, 9, 11, 3, 7, 2, 8, 4, 60, 61]
    r = prefilled(model, weights, prompt)
    steps = []
    for t in cont:
        out = r.forward(torch.tensor([t]))
        steps.append((out.logits[0], out.features[0]))
        r.commit([0])
    r = prefilled(model, weights, prompt)
    out = r.forward(torch.tensor(cont))
    for i, (logits, feats) in enumerate(steps):
        assert torch.equal(out.logits[i], logits), f"row {i} logits differ by {(out.logits[i] - logits).abs().max()}"
        assert torch.equal(out.features[i], feats)


@pytest.mark.parametrize("weights", PRECISIONS)
def test_a_tree_row_equals_decoding_its_path_bitwise(weights):
    model = long_model("qwen2", seed=2)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (13,), generator=g).tolist()
    tree = DraftTree(torch.randint(0, 97, (7,), generator=g), torch.tensor([-1, 0, 0, -1, 1, 3, 4]))
    root = 5
    r = prefilled(model, weights, prompt)
    toks = torch.cat([torch.tensor([root]), tree.tokens])
    pos = r.length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    out = r.forward(toks, pos, tree_mask(r.length, tree.ancestor_mask()))
    for node in range(-1, len(tree)):
        path = [root] + ([] if node < 0 else tree.tokens[tree.path_to(node)].tolist())
        ref = prefilled(model, weights, prompt)
        for t in path:
            last = ref.forward(torch.tensor([t])).logits[0]
            ref.commit([0])
        assert torch.equal(out.logits[node + 1], last), f"node {node}"


@pytest.mark.parametrize("weights", PRECISIONS)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculative_greedy_equals_vanilla_exactly(weights, shape):
    model = long_model("llama", seed=4)
    target = LeanRunner(model, weights=weights, exact=True)
    draft = LeanRunner(noisy_copy(model, 0.1), weights=weights, exact=True)
    drafter = DraftModelDrafter(draft, target.vocab_size, 4, TreeBudget(4, 3, 10) if shape == "tree" else None)
    taus = []
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 40)
        got, stats = run(target, drafter, prompt, SamplingParams(), 40)
        assert got == want  # no tie allowance: the rows are bit-identical
        taus.append(stats.tau)
    assert np.mean(taus) > 1.3


def test_reduced_precisions_stay_close_to_fp32_and_differ_from_it():
    model = long_model("llama", seed=6)
    prompt = list(range(5, 45))
    ref = LeanRunner(model).forward(torch.tensor(prompt)).logits
    for weights, tol in [("bf16", 0.05), ("fp16", 0.01), ("int8", 0.1), ("int4", 0.3)]:
        got = LeanRunner(model, weights=weights, exact=True).forward(torch.tensor(prompt)).logits
        rel = ((got - ref).norm() / ref.norm()).item()
        assert 0 < rel < tol, (weights, rel)  # a different model (rel > 0), and a close one


def test_int8_linear_is_row_local_and_accurate():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 40, generator=g), torch.randn(9, 40, generator=g)
    x[3] *= 100  # an outlier row must not coarsen the other rows' quantization
    lin = Linear(w, torch.randn(48, generator=g), precision="int8")
    y = lin(x)
    ref = x @ w.T + lin.bias
    assert ((y - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.05
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(9)]), y)


def test_a_long_reduction_is_split_until_rows_are_invariant():
    k = invariant_block(96, 2100, "fp32", torch.get_num_threads())
    assert 0 < k <= 2100
    lin = Linear(torch.randn(96, 2100), precision="fp32")
    x = torch.randn(16, 2100)
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(16)]), lin(x))


@pytest.mark.usefixtures("on_one_thread")
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_int8_sampling_matches_the_int8_targets_distribution(shape):
    v = 5
    model = flat_tiny(v)
    target = LeanRunner(model, weights="int8")
    drafter = DraftModelDrafter(LeanRunner(noisy_copy(model, 0.5)), v, 3,
                                TreeBudget(3, 2, 5) if shape == "tree" else None)
    params = SamplingParams(0.9, top_k=4)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) >= 3
    assert chi2_pvalue(counts, runner_first3(target, prompt, params, v)) > 1e-3


def test_weights_are_checked_and_need_the_lean_runner(monkeypatch):
    from specdec.runtime import stream

    with pytest.raises(SpecdecError, match="weights"):
        Runtime(weights="int3")
    with pytest.raises(SpecdecError, match="weights=int8 needs the lean runner"):
        make_runner(tiny_model("llama"), "hf", "int8")
    assert make_runner(tiny_model("llama"), "auto", "int8").weights == "int8"
    # exact rows at every precision on the fused kernels (row-by-row attention costs nothing there)
    assert make_runner(tiny_model("llama"), "auto", "int8").exact_rows > 0
    assert make_runner(tiny_model("llama"), "auto").exact_rows > 0
    # without them, only for a reduced precision (the fp32 fast path keeps greedy up to ties)
    monkeypatch.setattr(stream, "kernel", lambda: None)
    assert make_runner(tiny_model("llama"), "auto", "int8").exact_rows > 0
    assert make_runner(tiny_model("llama"), "auto").exact_rows == 0


def test_bench_weights_runs_our_methods_at_that_precision_and_audits_them(tmp_path):
    """`bench --weights int8`: our methods run the int8 target and are audited against int8 vanilla
    (exactly equal); the hf peer runs the fp32 model, so it is reported as agreement, not audited."""
    from specdec.bench.data import Question
    from specdec.bench.methods import parse_methods
    from specdec.bench.runner import BenchConfig, run_bench

    tok = char_tokenizer()
    target = tiny_model("llama", vocab_size=len(tok))
    specs = parse_methods("vanilla,sps:gamma=3,hf", has_draft=True)
    cfg = BenchConfig(specs, max_new_tokens=12, warmup_tokens=4, progress=False, threads=1, weights="int8")
    res = run_bench(cfg, [Question("1", "qa", ["Write a poem."])], target, tok, noisy_copy(target, 0.1), tok,
                    tmp_path / "out")
    assert res["audit"]["ok"] and res["audit"]["not_audited"] == ["hf"]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["config"]["weights"] == "int8"
    by = {r["name"]: r["tokens"] for r in res["records"]}
    assert by["sps"] == by["vanilla"]
