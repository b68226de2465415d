"""Hydra heads and drafting: training rows equal the runner's, the file round-trips and is told apart from
Medusa's, and decoding is lossless (exact at T = 0, chi-square at T > 0 with top-k and sampled children)."""

import pytest
import torch

from specdec.api import from_models
from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.hydra import HydraDrafter
from specdec.drafters.medusa import dense_choices, sparse_choices
from specdec.errors import SpecdecError
from specdec.heads.hydra import HydraHeads, HydraRunner
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.sampling import SamplingParams
from specdec.target.lean import LeanRunner
from tests import helpers
from tests.helpers import PROMPTS, chi2_pvalue, exact_first3, flat_tiny, make_hydra, run, sample_first3

ACC = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2]]


def runner_of(model, heads):
    return HydraRunner(heads, model.get_input_embeddings().weight, model.lm_head.weight)


@pytest.mark.parametrize("lm_head,reduced,layers", [("target", False, 1), ("own", True, 2)])
def test_training_rows_are_the_runners_steps_on_the_same_path(tiny, tmp_path, lm_head, reduced, layers):
    heads = make_hydra(tiny, 3, layers, lm_head, torch.arange(0, 97, 3) if reduced else None)
    save_medusa(heads, tmp_path / "h")
    back = load_medusa(tmp_path / "h", 64, 97, tiny.lm_head.weight, cls=HydraHeads)
    assert isinstance(back, HydraHeads) and back.meta["kind"] == "hydra"
    emb, lm = tiny.get_input_embeddings().weight.detach(), tiny.lm_head.weight.detach()
    ids, feats = torch.randint(0, 97, (2, 9)), torch.randn(2, 9, 64)
    hid = back.hidden_of(ids, feats, emb)  # [K, B, T - 2, H]
    assert hid.shape == (3, 2, 7, 64)
    runner = runner_of(tiny, back)
    for b, j, k in [(0, 0, 0), (1, 3, 1), (0, 4, 2), (1, 2, 2)]:
        rows = lm if back.lm_heads is None else back.lm_heads[k].weight
        rows = rows if back.d2t is None or back.lm_heads is not None else lm[back.d2t]
        want = hid[k, b, j] @ rows.T
        got = runner.step(k, feats[b, j], ids[b, j + 1:j + k + 2][None])[0]
        assert torch.allclose(got, want, atol=1e-4)
    # the path matters: another root gives other logits
    assert not torch.allclose(runner.step(1, feats[0, 0], torch.tensor([[3, 4]])),
                              runner.step(1, feats[0, 0], torch.tensor([[5, 4]])))


def test_hydra_and_medusa_files_are_told_apart(tiny, tmp_path):
    save_medusa(make_hydra(tiny, 2), tmp_path / "h")
    save_medusa(helpers.make_heads(tiny, 2, lm_head="target"), tmp_path / "m")
    with pytest.raises(SpecdecError, match="does not hold Medusa heads .* expected 'medusa'"):
        load_medusa(tmp_path / "h")
    with pytest.raises(SpecdecError, match="does not hold Hydra heads .* expected 'hydra'"):
        load_medusa(tmp_path / "m", cls=HydraHeads)
    with pytest.raises(SpecdecError, match="needs Hydra heads"):
        from_models(tiny, None, "hydra")
    with pytest.raises(SpecdecError, match="not a directory"):
        from_models(tiny, None, "hydra", heads=str(tmp_path / "nope"))


@pytest.mark.parametrize("lm_head,reduced", [("target", False), ("own", True)])
@pytest.mark.parametrize("tree", ["sparse", "dense"])
def test_hydra_greedy_equals_vanilla(tiny, lm_head, reduced, tree):
    heads = make_hydra(tiny, 4, 1, lm_head, torch.arange(0, 97, 2) if reduced else None)
    choices = {"sparse": sparse_choices(ACC, 10), "dense": dense_choices(4, 3, 10)}[tree]
    target = LeanRunner(tiny)
    drafter = HydraDrafter(runner_of(tiny, heads), choices)
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 30)
        got, stats = run(target, drafter, prompt, SamplingParams(), 30)
        assert got == want
        assert max(stats.tree_sizes) == len(choices)


def test_children_depend_on_the_parents_path(tiny):
    """Two depth-1 siblings with different tokens: head 1 runs on each path, so their best children
    are each head 1's argmax on that path (not one shared ranking as in Medusa)."""
    heads = make_hydra(tiny, 2, scale=3.0)
    runner = runner_of(tiny, heads)
    drafter = HydraDrafter(runner, [(0,), (1,), (0, 0), (1, 0)])
    target = LeanRunner(tiny)
    want, _ = run(target, NoDrafter(), PROMPTS[1], SamplingParams(), 1)
    got, stats = run(target, drafter, PROMPTS[1], SamplingParams(), 1)
    assert got == want
    f, root = drafter.feature, 0
    tree = drafter.propose(DecodeContext([root], SamplingParams(), None, 1))
    t = tree.tokens.tolist()
    assert tree.parents.tolist() == [-1, -1, 0, 1]
    for parent, child in ((0, 2), (1, 3)):
        assert t[child] == int(runner.step(1, f, torch.tensor([[root, t[parent]]]))[0].argmax())


def test_from_models_builds_hydra_from_a_saved_dir(tiny, tmp_path):
    save_medusa(make_hydra(tiny, 3), tmp_path / "h", extra={"accuracies": [[0.5, 0.2], [0.3, 0.1], [0.2]]})
    d = from_models(tiny, None, "hydra", heads=str(tmp_path / "h"), tree_size=4)
    assert d.drafter.name == "hydra" and len(d.drafter.choices) == 4
    want, _ = run(d.runner, NoDrafter(), PROMPTS[1], SamplingParams(), 24)
    got, stats = run(d.runner, d.drafter, PROMPTS[1], SamplingParams(), 24)
    assert got == want and max(stats.tree_sizes) == 4


@pytest.mark.slow
@pytest.mark.parametrize("params,children,reduced", [
    (SamplingParams(1.0), "topk", False), (SamplingParams(1.0), "sample", False),
    (SamplingParams(0.8, top_k=3), "sample", False), (SamplingParams(1.0), "sample", True)],
    ids=["topk-T1", "sampled-T1", "sampled-T0.8-topk3", "sampled-reduced-vocab-T1"])
def test_hydra_sampling_matches_vanilla_distribution(params, children, reduced):
    """Lossless at T > 0 with top-k children and with children drawn from each parent's own head
    distribution (q over the target vocabulary, zero outside a reduced draft vocabulary)."""
    model = flat_tiny()
    heads = make_hydra(model, 3, seed=3, vocab=torch.arange(0, model.config.vocab_size, 2) if reduced else None)
    choices = sparse_choices([[0.5, 0.3], [0.4, 0.3], [0.3]], 5)
    drafter = HydraDrafter(runner_of(model, heads), choices, children=children)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(LeanRunner(model), drafter, prompt, params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3
