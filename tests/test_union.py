"""EAGLE-2 + prompt lookup in one tree (UnionDrafter): merging, losslessness, sampling."""


import pytest
import torch

from specdec.drafters.base import NoDrafter
from specdec.errors import SpecdecError
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from tests.helpers import (
    PROMPTS,
    chi2_pvalue,
    drafter_for,
    exact_first3,
    flat_tiny,
    make_head,
    run,
    sample_first3,
)

# ---- EAGLE + prompt lookup in one tree ----

def test_tree_union_merges_shared_prefixes_and_keeps_order():
    from specdec.tree import DraftTree

    a = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]), torch.tensor([-0.1, -2.0, -0.5]))
    b = DraftTree.chain(torch.tensor([5, 7, 9]))  # shares 5 -> 7 with a, then adds 9
    b.scores = torch.tensor([-0.3, -0.2, -0.9])
    u = a.union(b)
    assert u.tokens.tolist() == [5, 6, 7, 9] and u.parents.tolist() == [-1, -1, 0, 2]
    assert u.scores.tolist() == pytest.approx([-0.1, -2.0, -0.2, -0.9])  # shared node: the higher score
    c = DraftTree.chain(torch.tensor([8, 5]))  # 5 under 8 is a different node from the root's 5
    assert a.union(c).parents.tolist() == [-1, -1, 0, -1, 3] and a.union(c).scores is None
    assert a.union(DraftTree.chain(torch.tensor([5]))) is a
    with pytest.raises(ValueError, match="deterministic"):
        a.union(DraftTree.chain(torch.tensor([1]), torch.full((1, 4), 0.25)))


def test_eagle2_with_lookup_is_lossless_and_uses_both_drafts(tiny, trained):
    from specdec.api import from_models

    head_dir = str(trained[1] / "head")
    target = LeanRunner(tiny)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]  # repeats: lookup has something to copy
    dec = from_models(tiny, None, "eagle2", head=head_dir, depth=2, topk=2, tree_size=3, lookup=6)
    assert dec.drafter.name == "eagle2+pld"
    for p in PROMPTS + [prompt]:
        want, _ = run(target, NoDrafter(), p, SamplingParams(), 40)
        got, stats = run(dec.runner, dec.drafter, p, SamplingParams(), 40)
        assert got == want
    assert max(stats.tree_sizes) > 3  # the lookup chain went into the tree beside the head's 3 nodes
    for bad in (-1, "x", 2.5):
        with pytest.raises(SpecdecError, match="lookup"):
            from_models(tiny, None, "eagle2", head=head_dir, lookup=bad)


@pytest.mark.slow
def test_eagle2_with_lookup_sampling_matches_vanilla_distribution():
    from specdec.drafters.prompt_lookup import PromptLookupDrafter
    from specdec.drafters.union import UnionDrafter

    model = flat_tiny()
    drafter = UnionDrafter(drafter_for(model, make_head(model, seed=3), True, depth=2, topk=2, tree_size=3),
                           PromptLookupDrafter(max_ngram=2, chain_len=3))
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    params = SamplingParams(1.0, top_p=0.9)
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) > 3  # lookup branches were verified too
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3
