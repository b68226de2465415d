"""EAGLE-1/2 drafting: the static tree, and losslessness (exact at T = 0, chi-square at T > 0)."""


import numpy as np
import pytest
import torch

from specdec.drafters.base import NoDrafter
from specdec.drafters.eagle import build_static_tree
from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from tests.helpers import (
    PROMPTS,
    SMALL_V,
    chi2_pvalue,
    drafter_for,
    exact_first3,
    flat_tiny,
    greedy_taus,
    make_head,
    run,
    sample_first3,
)

# ---- tree construction ----

def test_static_tree_follows_choices_by_rank():
    table = torch.log_softmax(torch.randn(10, 10, generator=torch.Generator().manual_seed(0)), -1)
    calls = []

    def step(sel, tokens, parents):
        calls.append(list(sel))
        return torch.stack([table[int(tokens[i])] for i in sel])

    root = table[0]
    tree = build_static_tree(root, step, [[1], [0], [0, 0], [0, 2], [1, 0], [0, 0, 0]])
    top = lambda row, k: int(torch.topk(row, k + 1).indices[k])  # noqa: E731
    t = tree.tokens.tolist()
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert t[0] == top(root, 0) and t[1] == top(root, 1)
    assert t[2] == top(table[t[0]], 0) and t[3] == top(table[t[0]], 2) and t[4] == top(table[t[1]], 0)
    assert t[5] == top(table[t[2]], 0)
    assert calls == [[0, 1], [2]]  # one step per depth, only nodes with children
    with pytest.raises(SpecdecError, match="needs its parent"):
        build_static_tree(root, step, [[0], [1, 0]])


# ---- losslessness ----

@pytest.mark.parametrize("dynamic", [False, True], ids=["eagle", "eagle2"])
@pytest.mark.parametrize("which", ["untrained", "trained", "trained-reduced"])
def test_eagle_greedy_equals_vanilla(tiny, trained, dynamic, which):
    if which == "untrained":
        head = make_head(tiny)
    else:
        head = trained[0]["head"]
        if which == "trained-reduced":
            head = load_head(trained[1] / "head")  # a reduced copy of the trained head
            keep = torch.arange(0, 97, 2)
            head.set_draft_vocab(keep, tiny.lm_head.weight.detach())
    target = LeanRunner(tiny)
    drafter = drafter_for(tiny, head, dynamic, **({"depth": 4, "topk": 3, "tree_size": 8} if dynamic else {}))
    taus = greedy_taus(target, drafter, PROMPTS)
    if which == "trained":  # a trained head gets drafts accepted, so the accept paths really run
        assert np.mean(taus) > 1.5


def test_eagle2_ablations_and_api_are_lossless(tiny, trained):
    from specdec.api import from_models

    head_dir = str(trained[1] / "head")
    target = LeanRunner(tiny)
    want, _ = run(target, NoDrafter(), PROMPTS[1], SamplingParams(), 30)
    for opts in ({"rank_by": "confidence"}, {"rerank": False}, {"gamma": 3, "topk": 2, "tree_tokens": 5}):
        dec = from_models(tiny, None, "eagle2", head=head_dir, **opts)
        got, _ = run(dec.runner, dec.drafter, PROMPTS[1], SamplingParams(), 30)
        assert got == want, opts
    dec = from_models(tiny, None, "eagle", head=head_dir, choices=[[0], [0, 0], [0, 0, 0]])
    got, s = run(dec.runner, dec.drafter, PROMPTS[1], SamplingParams(), 30)
    assert got == want and max(s.tree_sizes) == 3
    with pytest.raises(SpecdecError, match="unknown option"):
        from_models(tiny, None, "eagle", head=head_dir, bogus=1)


def test_full_vocab_ablation_restores_the_whole_target_head(tiny, trained, tmp_path):
    from specdec.api import from_models

    head = load_head(trained[1] / "head")
    head.set_draft_vocab(torch.arange(0, 97, 3), tiny.lm_head.weight.detach())  # target rows, as shipped
    save_head(head, tmp_path / "reduced", lm_head=False)
    target = LeanRunner(tiny)
    want, _ = run(target, NoDrafter(), PROMPTS[2], SamplingParams(), 30)
    reduced = from_models(tiny, None, "eagle2", head=str(tmp_path / "reduced"))
    full = from_models(tiny, None, "eagle2", head=str(tmp_path / "reduced"), full_vocab=True)
    assert reduced.drafter.runner.d2t is not None and full.drafter.runner.d2t is None
    h = torch.randn(2, 64)
    assert full.drafter.runner.logits(h).shape == (2, 97)
    # the reduced head's logits are exactly the full head's logits at the kept ids
    torch.testing.assert_close(reduced.drafter.runner.logits(h), full.drafter.runner.logits(h)[:, ::3])
    for dec in (reduced, full):
        got, _ = run(dec.runner, dec.drafter, PROMPTS[2], SamplingParams(), 30)
        assert got == want
    save_head(head, tmp_path / "own")  # trained-in rows: "full vocabulary" would be another model
    with pytest.raises(SpecdecError, match="full_vocab needs"):
        from_models(tiny, None, "eagle2", head=str(tmp_path / "own"), full_vocab=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dynamic,params", [(True, SamplingParams(1.0)), (False, SamplingParams(0.8, top_k=3))],
    ids=["eagle2-T1", "eagle-T0.8-topk3"])
def test_eagle_sampling_matches_vanilla_distribution(dynamic, params):
    model = flat_tiny()
    head = make_head(model, seed=3)
    kw = {"depth": 3, "topk": 2, "tree_size": 5} if dynamic else {"choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}
    drafter = drafter_for(model, head, dynamic, **kw)
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("params,draft_vocab,coupled", [  # each sampling, seeded and not; the reduced vocabulary both
    (SamplingParams(1.0), None, False), (SamplingParams(0.8, top_k=3), None, True),
    (SamplingParams(1.2, top_p=0.85), list(range(0, SMALL_V, 2)), False),
    (SamplingParams(1.2, top_p=0.85), list(range(0, SMALL_V, 2)), True)],
    ids=["unseeded-T1", "seeded-T0.8-topk3", "unseeded-T1.2-topp-reduced", "seeded-T1.2-topp-reduced"])
def test_eagle2_sampled_children_match_vanilla_distribution(params, draft_vocab, coupled):
    """Unseeded: children drawn without replacement from the draft, each with its q (recursive rejection).
    Seeded: children ranked by log q + the coupling's noise (point masses). Both exact."""
    model = flat_tiny()
    head = make_head(model, seed=3, draft_vocab=draft_vocab)
    drafter = drafter_for(model, head, True, depth=3, topk=2, tree_size=5, children="sample")
    counts, sizes = sample_first3(LeanRunner(model), drafter, [1, 3, 0, 2], params, coupled=coupled)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, [1, 3, 0, 2], params)) > 1e-3


def test_draw_children_is_an_ordered_sample_without_replacement():
    from specdec.tree import draw_children

    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]), -1)
    g = torch.Generator().manual_seed(0)
    n = 20000
    lp, tok, q, ok = draw_children(logp.expand(n, -1), 3, g)
    assert ok.all()
    p = logp.exp()[0]
    assert (tok[:, 0] != tok[:, 1]).all() and (tok[:, 1] != tok[:, 2]).all() and (tok[:, 0] != tok[:, 2]).all()
    torch.testing.assert_close(lp, logp.expand(n, -1).gather(-1, tok))
    # q of the 1st child is p; of the 2nd, p without the 1st, renormalised
    torch.testing.assert_close(q[:, 0], p.expand(n, -1))
    first = tok[:, 0]
    want2 = p.expand(n, -1).scatter(1, first[:, None], 0.0)
    torch.testing.assert_close(q[:, 1], want2 / want2.sum(-1, keepdim=True))
    # the draws follow those distributions: the 1st child's marginal, and the 2nd's given the 1st is token 0
    assert chi2_pvalue(np.bincount(first.numpy(), minlength=5), p.numpy()) > 1e-3
    given0 = tok[first == 0, 1]
    assert chi2_pvalue(np.bincount(given0.numpy(), minlength=5)[1:], (p[1:] / p[1:].sum()).numpy()) > 1e-3
    # a support of one token (a tiny temperature): one child, no NaN q for the others
    one = torch.log_softmax(torch.tensor([[0.0, float("-inf"), float("-inf")]]), -1)
    _, tok, q, ok = draw_children(one, 3, g)
    assert ok.tolist() == [[True, False, False]] and tok[0, 0] == 0 and not q[ok].isnan().any()


def test_sampled_children_options_are_checked():
    from specdec.drafters import registry

    with pytest.raises(SpecdecError, match="children"):
        registry.parse("eagle2", {"children": "sample", "lookup": 4})
    with pytest.raises(SpecdecError, match="children"):
        registry.parse("eagle2", {"children": "beam"})


@pytest.mark.slow
def test_reranking_sampled_children_by_value_would_be_biased(monkeypatch):
    """Why sampled_tree keeps the expansion's first nodes instead of the top ones by value: pruning a
    sampled node by its own value changes its distribution away from its q (the chi-square test sees it)."""
    import specdec.drafters.eagle as eagle_mod
    import specdec.tree as tree_mod

    def reranked(root, depth, topk, size, gen):
        t = yield from tree_mod.sampled_tree(root, depth, topk, 10**6, gen)
        return t.select(torch.argsort(-t.scores, stable=True)[:size].sort().values)

    monkeypatch.setattr(eagle_mod, "sampled_tree", reranked)
    model = flat_tiny()
    drafter = drafter_for(model, make_head(model, seed=3), True, depth=3, topk=2, tree_size=3, children="sample")
    counts, _ = sample_first3(LeanRunner(model), drafter, [1, 3, 0, 2], SamplingParams(1.0), n=2500,
                              coupled=False)
    assert chi2_pvalue(counts, exact_first3(model, [1, 3, 0, 2], SamplingParams(1.0))) < 1e-6


def test_eagle2_samples_children_by_default_unless_a_lookup_chain_shares_the_tree():
    from specdec.drafters import registry
    from specdec.drafters.eagle import children

    assert children(registry.parse("eagle2", {})[1]) == "sample"
    assert children(registry.parse("eagle2", {"lookup": 4})[1]) == "topk"
    assert children(registry.parse("fspad", {"head": "x", "children": "topk"})[1]) == "topk"
    assert registry.parse("auto", {"children": "sample", "lookup": 4})[1].children == "sample"  # never merged
    with pytest.raises(SpecdecError, match="children=sample cannot share its tree with a lookup chain"):
        registry.parse("auto", {"children": "sample", "lookup": 4, "adaptive": False})  # static: merged
