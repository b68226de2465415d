"""Losslessness of the verifier, checked statistically on a tiny Markov "language".

The target and the drafter are Markov tables over a 6-token vocabulary, so the exact distribution of
the first two emitted tokens is known. For each draft shape (sampled chain, sampled siblings, top-k
point-mass tree) and sampling setting, 8k verifications must match it (chi-square), and a verifier
with a classic bug must fail the very same test.
"""

import numpy as np
import pytest
import torch

from specdec.sampling import Coupling, SamplingParams, argmax_rows, probs_from_logits, sample
from specdec.tree import DraftTree
from specdec.verify import Verdict, verify
from tests.helpers import chi2_pvalue

V = 6
_g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=_g) * 1.5  # logits of the next token given the last one
DRAFT = TARGET + torch.randn(V, V, generator=_g) * 1.0  # a similar but different drafter


def make_tree(shape: str, root: int, params: SamplingParams, g: torch.Generator) -> DraftTree:
    """Draft from the DRAFT table; q are the exact proposal distributions."""
    q_table = probs_from_logits(DRAFT, params)
    q_of = q_table.__getitem__
    toks, parents, qs = [], [], []

    def add(tok, parent, q):
        toks.append(tok)
        parents.append(parent)
        qs.append(q)
        return len(toks) - 1

    if shape == "chain":
        last, par = root, -1
        for _ in range(3):
            q = q_of(last)
            last = int(torch.multinomial(q, 1, generator=g))
            par = add(last, par, q)
        return DraftTree(torch.tensor(toks), torch.tensor(parents), draft_probs=torch.stack(qs))
    if shape == "siblings":  # 2 children drawn without replacement at the root, each with one child
        q = q_of(root)
        a = int(torch.multinomial(q, 1, generator=g))
        q2 = q.clone()
        q2[a] = 0
        q2 = q2 / q2.sum() if q2.sum() > 0 else q
        firsts = [(a, q)]
        if q2.sum() > 0 and q2[a] == 0:
            firsts.append((int(torch.multinomial(q2, 1, generator=g)), q2))
        for tok, qq in firsts:
            i = add(tok, -1, qq)
            qc = q_of(tok)
            add(int(torch.multinomial(qc, 1, generator=g)), i, qc)
        # DraftTree needs topological order: ours is (a, a's child, b, b's child)
        return DraftTree(torch.tensor(toks), torch.tensor(parents), draft_probs=torch.stack(qs))
    if shape == "topk":  # deterministic top-2 children of the root, top-1 child below each
        top = torch.topk(DRAFT[root], 2).indices.tolist()
        for tok in top:
            i = add(tok, -1, None)
            add(int(DRAFT[tok].argmax()), i, None)
        return DraftTree(torch.tensor(toks), torch.tensor(parents))
    raise ValueError(shape)


def target_logits(tree: DraftTree, root: int) -> torch.Tensor:
    last = [root] + tree.tokens.tolist()
    return TARGET[torch.tensor(last)]


def exact_joint(params: SamplingParams, root: int) -> np.ndarray:
    p1 = probs_from_logits(TARGET[root], params)
    p2 = probs_from_logits(TARGET, params)  # [V, V]
    return (p1[:, None] * p2).numpy().reshape(-1)


def empirical_joint(verify_fn, shape, params, root=0, trials=8000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V * V)
    p2 = probs_from_logits(TARGET, params)
    for _ in range(trials):
        tree = make_tree(shape, root, params, g)
        out = verify_fn(tree, target_logits(tree, root), params, g).tokens
        if len(out) == 1:  # continue as vanilla sampling would
            out = out + [int(torch.multinomial(p2[out[0]], 1, generator=g))]
        counts[out[0] * V + out[1]] += 1
    return counts


def test_inverse_cdf_sample_follows_the_weights_and_never_draws_a_zero():
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 5.5, 0.0])  # unnormalised; zeros inside and at both ends
    g = torch.Generator().manual_seed(0)
    counts = np.bincount([sample(w, g) for _ in range(20000)], minlength=len(w))
    assert chi2_pvalue(counts, (w / w.sum()).numpy()) > 1e-3  # also asserts no zero-weight token was drawn
    assert sample(torch.tensor([0.0, 0.0, 2.0, 0.0]), g) == 2


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "siblings", "topk"])
@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-topk3", "T1.3-topp0.8"])
def test_verifier_is_exact_in_distribution(shape, params):
    counts = empirical_joint(verify, shape, params)
    assert chi2_pvalue(counts, exact_joint(params, 0)) > 1e-3


def broken_verify(tree, logits, params, g):
    """The classic bug: on rejection, sample the bonus from p instead of the residual max(0, p - q)."""
    probs = probs_from_logits(logits, params)
    path, row = [], 0
    children = tree.children()
    while children[row]:
        c = children[row][0]
        x = int(tree.tokens[c])
        q = 1.0 if tree.draft_probs is None else float(tree.draft_probs[c][x])
        if float(torch.rand(1, generator=g)) < min(1.0, float(probs[row][x]) / q):
            path.append(c)
            row = c + 1
        else:
            break
    bonus = int(torch.multinomial(probs[row], 1, generator=g))
    return Verdict(path, [int(tree.tokens[i]) for i in path] + [bonus], bonus)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "topk"])
def test_the_test_has_power_against_a_broken_verifier(shape):
    params = SETTINGS[0]
    counts = empirical_joint(broken_verify, shape, params)
    assert chi2_pvalue(counts, exact_joint(params, 0)) < 1e-6


def test_greedy_follows_argmax():
    tree = DraftTree(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, 1]))
    logits = torch.zeros(4, 8)
    logits[0, 4] = 1  # root -> 4 (node 1)
    logits[2, 5] = 1  # node 1 -> 5 (node 2)
    logits[3, 7] = 1  # bonus after node 2
    v = verify(tree, logits, SamplingParams())
    assert v.path == [1, 2] and v.tokens == [4, 5, 7]


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=7)
    g1, g2 = params.generator("cpu"), params.generator("cpu")
    a = [verify(make_tree("chain", 0, params, g1), TARGET[:4], params, g1).tokens for _ in range(20)]
    b = [verify(make_tree("chain", 0, params, g2), TARGET[:4], params, g2).tokens for _ in range(20)]
    assert a == b


@pytest.mark.parametrize(
    "kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(temperature=float("nan"))]
)
def test_invalid_sampling_parameters(kw):
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError):
        SamplingParams(**kw)


# ---- coupled draws (seeded requests): the token at a position is a function of seed, position and p ----

def coupled_joint(verify_fn, shape, params, root=0, trials=6000, position=4):
    """Trial s: seed s; drafts from make_tree (its own generator: the drafts must not matter)."""
    g = torch.Generator().manual_seed(99)
    counts = np.zeros(V * V)
    p2 = probs_from_logits(TARGET, params)
    for s in range(trials):
        c = Coupling(s, V)
        tree = make_tree(shape, root, params, g)
        out = verify_fn(tree, target_logits(tree, root), params, c, position)
        if len(out) == 1:  # continue as vanilla would: the draw at the next position
            out = out + [c.pick(p2[out[0]], position + 1)]
        counts[out[0] * V + out[1]] += 1
    return counts


def coupled_verify(tree, logits, params, coupling, position):
    return verify(tree, logits, params, coupling=coupling, position=position).tokens


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "siblings", "topk"])
@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-topk3", "T1.3-topp0.8"])
def test_coupled_verifier_is_exact_in_distribution(shape, params):
    counts = coupled_joint(coupled_verify, shape, params)
    assert chi2_pvalue(counts, exact_joint(params, 0)) > 1e-3


@pytest.mark.slow
def test_the_coupled_test_has_power_against_noise_reused_across_positions():
    """The classic bug of a coupling: one noise vector for every position correlates consecutive tokens."""
    def reused(tree, logits, params, coupling, position):
        probs = probs_from_logits(logits, params)
        first = coupling.pick(probs[0], position)
        node = next((i for i in tree.children()[0] if int(tree.tokens[i]) == first), None)
        if node is None:
            return [first]
        return [first, coupling.pick(probs[node + 1], position)]  # the bug: the same position's noise again

    params = SETTINGS[0]
    counts = coupled_joint(reused, "topk", params)
    assert chi2_pvalue(counts, exact_joint(params, 0)) < 1e-6


@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-topk3", "T1.3-topp0.8"])
def test_coupled_tokens_do_not_depend_on_the_draft(params):
    """For one seed the emitted tokens are the target's draws, whatever tree was verified."""
    g = torch.Generator().manual_seed(5)
    for s in range(200):
        c = Coupling(s, V)
        want = [c.pick(probs_from_logits(TARGET[0], params), 7)]
        want.append(c.pick(probs_from_logits(TARGET[want[0]], params), 8))
        for shape in ("chain", "siblings", "topk"):
            tree = make_tree(shape, 0, params, g)
            out = verify(tree, target_logits(tree, 0), params, coupling=c, position=7).tokens
            assert out[:2] == want[:len(out)]


def test_coupling_draws_depend_on_seed_and_position_only():
    a, b = Coupling(3, 50), Coupling(3, 50)
    assert torch.equal(a.gumbel(10), b.gumbel(10)) and not torch.equal(a.gumbel(10), a.gumbel(11))
    assert not torch.equal(a.gumbel(10), Coupling(4, 50).gumbel(10))
    lp = torch.log_softmax(torch.randn(2, 20), -1)
    ids = torch.arange(30, 50)  # a reduced draft vocabulary: columns are target ids 30..49
    want = torch.log_softmax(lp + torch.stack([a.gumbel(10)[ids], a.gumbel(11)[ids]]).float(), -1)
    assert torch.allclose(a.perturb(lp, [10, 11], ids), want)


def test_the_coupled_draw_is_the_gumbel_max_of_the_noise_drafters_rank_by():
    """pick() takes the exponential race argmax p / E; a drafter ranks by log q + G with G = -log E: the draw
    must be argmax(log p + G) for that G, or drafts would chase another token than the target draws."""
    c, g = Coupling(5, 300), torch.Generator().manual_seed(0)
    for i in range(200):
        p = torch.softmax(torch.randn(300, generator=g) * (0.5 + i % 7), -1)
        p[torch.rand(300, generator=g) < 0.3] = 0.0  # top-k / top-p zeros: never drawn
        p = p / p.sum()
        x = c.pick(p, i)
        assert x == int((torch.log(p.double()) + c.gumbel(i)).argmax()) and p[x] > 0
    assert torch.equal(c.gumbel(3), -torch.log(c.exponential(3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_rows_is_torchs_argmax_ties_nan_and_strides_included(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (7, 500), generator=g).to(dtype)  # few distinct values: many tied maxima
    x[2, 17] = x[2, 300] = float("nan")
    x[5] = 1.0  # all equal: the first
    for rows in (x, x[1:6:2], x[:, ::3], x[4], x[:1]):
        assert argmax_rows(rows) == rows.argmax(-1).tolist()
    assert argmax_rows(x)[2] == 17 and argmax_rows(x)[5] == 0
