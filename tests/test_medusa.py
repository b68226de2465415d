"""Medusa drafting: the heads' lean runner, sparse/dense trees, losslessness (exact at T = 0, chi-square at
T > 0 with top-k/top-p) and typical acceptance (greedy at T = 0, marked lossy otherwise)."""

import itertools
import math

import numpy as np
import pytest
import torch

from specdec.api import from_models
from specdec.drafters.base import NoDrafter
from specdec.drafters.medusa import (
    MedusaDrafter,
    best_size,
    dense_choices,
    expected_accepted,
    sparse_choices,
    tree_rate,
)
from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaHeads, MedusaRunner
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.verify import Typical, verify
from tests import helpers
from tests.helpers import (
    PROMPTS,
    SMALL_V,
    chi2_pvalue,
    exact_first3,
    flat_tiny,
    run,
    sample_first3,
    tiny_model,
    word_tokenizer,
)

ACC = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2]]


def make_heads(model, k=4, layers=1, lm_head="target", vocab=None, seed=0, scale=0.3):
    return helpers.make_heads(model, k, layers, lm_head, vocab, seed, scale, lm_noise=0.0)


# ---- trees ----

def test_sparse_tree_is_the_best_n_paths_by_expected_acceptance():
    value = lambda c: math.prod(ACC[d][i] for d, i in enumerate(c))  # noqa: E731
    every = [c for n in range(1, 5) for c in itertools.product(*(range(len(ACC[d])) for d in range(n)))]
    for n in (1, 3, 7, 12, 20):
        got = sparse_choices(ACC, n)
        assert len(got) == n and len(set(got)) == n
        assert all(len(c) == 1 or c[:-1] in got for c in got)  # a tree
        best = sorted((value(c) for c in every), reverse=True)[:n]
        assert sorted((value(c) for c in got), reverse=True) == pytest.approx(best)
        assert expected_accepted(ACC, got) == pytest.approx(sum(best))


def test_dense_tree_fills_levels_and_the_budget_trades_acceptance_for_cost():
    assert dense_choices(3, 2, 6) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(dense_choices(2, 2, 50)) == 6  # all there is
    # at equal size the sparse tree expects more accepted tokens than the dense one (the paper's point)
    assert expected_accepted(ACC, sparse_choices(ACC, 6)) > expected_accepted(ACC, dense_choices(4, 2, 6))
    def flat(n):  # verifying is free: the biggest tree wins
        return 0.02

    def steep(n):  # every row costs a full forward: no tree pays
        return 0.02 * n

    assert best_size(ACC, flat, 0.0) == 48  # every path there is (3 + 9 + 18 + 18)
    assert best_size(ACC, steep, 0.0) == 1
    assert tree_rate(ACC, sparse_choices(ACC, 4), flat, 0.0) > tree_rate(ACC, [(0,)], flat, 0.0)


# ---- the runner equals the module ----

@pytest.mark.parametrize("lm_head,reduced,layers", [("target", False, 1), ("own", False, 2), ("target", True, 2),
                                                    ("own", True, 1)])
def test_runner_and_saved_heads_give_the_modules_logits(tiny, tmp_path, lm_head, reduced, layers):
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 3, layers, lm_head, torch.arange(0, 97, 3) if reduced else None)
    save_medusa(heads, tmp_path / "m")
    back = load_medusa(tmp_path / "m", 64, 97, lm)
    f = torch.randn(5, 64)
    want = heads.logits(f, lm)
    assert torch.equal(back.logits(f, lm), want)
    runner = MedusaRunner(back, lm)
    for r in range(5):
        assert torch.allclose(runner.logits(f[r]), want[:, r], atol=1e-5)
    ids = torch.tensor([0, 1])
    assert runner.to_target(ids).tolist() == ([0, 3] if reduced else [0, 1])


def test_a_mismatched_or_damaged_file_is_one_clear_error(tiny, tmp_path):
    heads = make_heads(tiny, 2)
    save_medusa(heads, tmp_path / "m")
    with pytest.raises(SpecdecError, match="hidden size 64 but the target has 32"):
        load_medusa(tmp_path / "m", 32, 97)
    with pytest.raises(SpecdecError, match="vocabulary of 97 tokens but the target has 50"):
        load_medusa(tmp_path / "m", 64, 50)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecdecError, match="damaged"):
        load_medusa(tmp_path / "m")
    with pytest.raises(SpecdecError, match="config.json is missing"):
        load_medusa(tmp_path)


# ---- losslessness ----

@pytest.mark.parametrize("lm_head,reduced", [("target", False), ("own", True)])
@pytest.mark.parametrize("tree", ["sparse", "dense", "chain"])
def test_medusa_greedy_equals_vanilla(tiny, lm_head, reduced, tree):
    heads = make_heads(tiny, 4, 1, lm_head, torch.arange(0, 97, 2) if reduced else None)
    choices = {"sparse": sparse_choices(ACC, 10), "dense": dense_choices(4, 3, 10),
               "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]}[tree]
    target = LeanRunner(tiny)
    drafter = MedusaDrafter(MedusaRunner(heads, tiny.lm_head.weight), choices)
    accepted = 0
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 30)
        got, stats = run(target, drafter, prompt, SamplingParams(), 30)
        assert got == want
        assert max(stats.tree_sizes) == len(choices)
        accepted += sum(stats.accept_lengths) - len(stats.accept_lengths)
    assert accepted > 0  # the heads' drafts were checked and some were right, not only bonus tokens


def test_identity_heads_draft_the_targets_own_next_token_at_depth_one(tiny):
    """Medusa's init (blocks = identity, LM heads = the target's): head 0 on f_t proposes argmax LM(f_t),
    the token the root already is, so depth 1 is accepted exactly when the target repeats a token."""
    heads = MedusaHeads(64, 97, 2, 1, "own")
    heads.init_lm_heads(tiny.lm_head.weight.detach())
    runner = MedusaRunner(heads, tiny.lm_head.weight)
    f = torch.randn(64)
    assert torch.allclose(runner.logits(f)[0], tiny.lm_head.weight @ f, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("tree,params,children", [
    ("sparse", SamplingParams(1.0), "topk"), ("dense", SamplingParams(0.8, top_k=3), "topk"),
    ("sparse", SamplingParams(1.2, top_p=0.85), "topk"), ("sparse", SamplingParams(1.0), "sample"),
    ("dense", SamplingParams(0.8, top_k=3), "sample"), ("gap", SamplingParams(1.2, top_p=0.85), "sample"),
    ("reduced", SamplingParams(1.0), "sample")],
    ids=["sparse-T1", "dense-T0.8-topk3", "sparse-T1.2-topp0.85", "sampled-sparse-T1", "sampled-dense-T0.8-topk3",
         "sampled-rank-gap-T1.2-topp0.85", "sampled-reduced-vocab-T1"])
def test_medusa_sampling_matches_vanilla_distribution(tree, params, children):
    """Lossless at T > 0 with top-k children (point masses) and with children drawn from the heads
    (recursive rejection against their q), including a tree whose ranks skip one ({0, 2}: draws 0 and 1)
    and a reduced draft vocabulary (q is zero outside it)."""
    model = flat_tiny()
    heads = make_heads(model, 3, seed=3, vocab=torch.arange(0, SMALL_V, 2) if tree == "reduced" else None)
    choices = {"sparse": sparse_choices([[0.5, 0.3], [0.4, 0.3], [0.3]], 5), "dense": dense_choices(3, 2, 6),
               "gap": [(0,), (2,), (0, 0), (0, 2), (2, 1), (0, 0, 0)],
               "reduced": sparse_choices([[0.5, 0.3], [0.4, 0.3], [0.3]], 5)}[tree]
    drafter = MedusaDrafter(MedusaRunner(heads, model.lm_head.weight), choices, children=children)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(LeanRunner(model), drafter, prompt, params)
    assert max(sizes) >= 4  # the engine cuts trees at what 6 tokens can still use
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


# ---- typical acceptance ----

def test_typical_acceptance_takes_the_longest_path_that_passes_and_is_greedy_at_t0():
    # rows: the root's, then node 0's, node 1's, node 2's
    logits = torch.log(torch.tensor([[0.7, 0.25, 0.05], [0.1, 0.8, 0.1], [0.9, 0.05, 0.05], [1 / 3, 1 / 3, 1 / 3]]))
    rule = Typical(epsilon=0.09, delta=0.3)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    # node 0: token 2 (p 0.05 < 0.09: fails); node 1: token 0 (0.7 passes) -> node 2: token 0 (0.9 passes)
    tree = DraftTree(torch.tensor([2, 0, 0]), torch.tensor([-1, -1, 1]))
    v = verify(tree, logits, SamplingParams(1.0), gen(), rule)
    assert v.path == [1, 2] and len(v.tokens) == 3
    # node 2: token 1, p 0.05 under a threshold of min(0.09, 0.3 exp(-H)) = 0.09: the path stops at node 1
    tree2 = DraftTree(torch.tensor([2, 0, 1]), torch.tensor([-1, -1, 1]))
    assert verify(tree2, logits, SamplingParams(1.0), gen(), rule).path == [1]
    h = float(-(logits[2].exp() * logits[2]).sum())
    assert min(0.09, 0.3 * math.exp(-h)) == 0.09
    for t in (tree, tree2):  # T = 0: exactly the greedy verdict
        assert verify(t, logits, SamplingParams(), None, rule) == verify(t, logits, SamplingParams(), None)


def test_typical_acceptance_is_marked_lossy_and_greedy_stays_exact(tiny, tmp_path):
    heads = make_heads(tiny, 3)
    save_medusa(heads, tmp_path / "m", extra={"accuracies": [[0.5, 0.2], [0.3, 0.1], [0.2]]})
    lossless = from_models(tiny, None, "medusa", heads=str(tmp_path / "m"), tree_size=6)
    typical = from_models(tiny, None, "medusa", heads=str(tmp_path / "m"), tree_size=6, typical=True)
    prompt, greedy, sampled = PROMPTS[1], SamplingParams(), SamplingParams(1.0, seed=1)
    want, _ = run(lossless.runner, NoDrafter(), prompt, greedy, 24)
    for d in (lossless, typical):
        out, stats = run(d.runner, d.drafter, prompt, greedy, 24)
        assert out == want and stats.acceptance == "lossless" and stats.summary()["acceptance"] == "lossless"
    _, stats = run(typical.runner, typical.drafter, prompt, sampled, 24)
    assert stats.acceptance.startswith("LOSSY typical(epsilon=0.09") and typical.drafter.name == "medusa:typical"
    assert run(lossless.runner, lossless.drafter, prompt, sampled, 24)[1].acceptance == "lossless"


@pytest.mark.slow
def test_typical_acceptance_drifts_from_the_target_distribution_and_the_kl_is_measurable():
    """Lossy means measurably so: on a 5-token model the first-3 joint under typical acceptance is
    far from vanilla's (chi-square rejects) while the lossless verifier on the same tree is not."""
    model = flat_tiny()
    heads = make_heads(model, 3, seed=3)
    choices = dense_choices(3, 2, 6)
    params = SamplingParams(1.0)
    exact = exact_first3(model, [1, 3, 0, 2], params)
    drafter = MedusaDrafter(MedusaRunner(heads, model.lm_head.weight), choices, Typical(0.3, 0.6))
    counts, _ = sample_first3(LeanRunner(model), drafter, [1, 3, 0, 2], params, n=2000)
    emp = counts / counts.sum()
    kl = float(np.sum(np.where(emp > 0, emp * np.log(np.maximum(emp, 1e-12) / np.maximum(exact, 1e-12)), 0.0)))
    assert kl > 0.01
    assert chi2_pvalue(counts, exact) < 1e-3


# ---- options ----

def test_medusa_options_fail_before_any_model_loads(tiny, tmp_path):
    with pytest.raises(SpecdecError, match="needs Medusa heads for this model: pass heads=<dir>"):
        from_models(tiny, None, "medusa")  # none ship for this target
    with pytest.raises(SpecdecError, match="tree"):
        from_models(tiny, None, "medusa", heads=str(tmp_path), tree="bushy")
    save_medusa(make_heads(tiny, 2), tmp_path / "m")
    with pytest.raises(SpecdecError, match="depth 3 needs 3 Medusa heads"):
        from_models(tiny, None, "medusa", heads=str(tmp_path / "m"), choices=[[0], [0, 0], [0, 0, 0]])
    with pytest.raises(SpecdecError, match="not a directory"):
        from_models(tiny, None, "medusa", heads=str(tmp_path / "nope"))
    with pytest.raises(SpecdecError, match="children=sample cannot be combined with typical=true"):
        from_models(tiny, None, "medusa", heads=str(tmp_path / "nope"), typical=True, children="sample")


def test_heads_without_accuracies_fall_back_to_a_dense_tree(tiny, tmp_path):
    save_medusa(make_heads(tiny, 3), tmp_path / "m")
    d = from_models(tiny, None, "medusa", heads=str(tmp_path / "m"), topk=2)
    assert d.drafter.choices == [tuple(c) for c in dense_choices(3, 2, 4)]


def test_bench_never_audits_typical_acceptance_as_lossless():
    from specdec.bench.methods import parse_method

    lossy = parse_method("medusa:heads=somewhere:typical=true")
    assert lossy.lossy and not lossy.audited
    exact = parse_method("medusa:heads=somewhere")
    assert not exact.lossy and exact.audited


def test_the_stats_line_says_lossy_when_typical_acceptance_ran(tmp_path, capsys):
    from specdec.cli import main

    model = tiny_model("llama", vocab_size=7)
    model.save_pretrained(tmp_path / "t")
    word_tokenizer([f"w{i}" for i in range(5)]).save_pretrained(tmp_path / "t")
    save_medusa(make_heads(model, 3), tmp_path / "m", extra={"accuracies": [[0.5, 0.2], [0.3, 0.1], [0.2]]})
    base = ["generate", "w1 w2", "--raw", "--model", str(tmp_path / "t"), "--method", "medusa", "--opt",
            f"heads={tmp_path / 'm'}", "--max-new-tokens", "8", "--temperature", "1", "--seed", "1"]
    assert main([*base, "--typical"]) == 0
    assert "acceptance LOSSY typical(" in capsys.readouterr().err
    assert main(base) == 0
    assert "LOSSY" not in capsys.readouterr().err
