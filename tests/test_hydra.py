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
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from tests import helpers
from tests.helpers import PROMPTS, chi2_pvalue, exact_first3, flat_tiny, make_hydra, run, sample_first3

ACC = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2]]


def runner_of(model, heads):
    return HydraRunner(heads, model.get_input_embeddings().weight, model.lm_head.weight)


@pytest.mark.parametrize("lm_head,reduced,layers,prefix", [("target", False, 1, False), ("own", True, 2, False),
                                                           ("target", True, 1, True)])
def test_training_rows_are_the_runners_steps_on_the_same_path(tiny, tmp_path, lm_head, reduced, layers, prefix):
    heads = make_hydra(tiny, 3, layers, lm_head, torch.arange(0, 97, 3) if reduced else None, prefix=prefix)
    save_medusa(heads, tmp_path / "h")
    back = load_medusa(tmp_path / "h", 64, 97, tiny.lm_head.weight, cls=HydraHeads)
    assert isinstance(back, HydraHeads) and back.meta["kind"] == "hydra" and (back.prefix is not None) == prefix
    for k, v in heads.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    emb, lm = tiny.get_input_embeddings().weight.detach(), tiny.lm_head.weight.detach()
    ids, feats = torch.randint(0, 97, (2, 9)), torch.randn(2, 9, 64)
    hid = back.hidden_of(ids, feats, emb)  # [K, B, T - 2, H]
    assert hid.shape == (3, 2, 7, 64)
    runner = runner_of(tiny, back)
    for b, j, k in [(0, 0, 0), (1, 3, 1), (0, 4, 2), (1, 2, 2)]:
        rows = lm if back.lm_heads is None else back.lm_heads[k].weight
        rows = rows if back.d2t is None or back.lm_heads is not None else lm[back.d2t]
        want = hid[k, b, j] @ rows.T
        f = runner.begin(feats[b, :j + 1])  # the prefix layer over rows 0..j (or f_j itself)
        assert torch.allclose(f, feats[b, j]) != prefix
        got = runner.step(k, f, ids[b, j + 1:j + k + 2][None])[0]
        assert torch.allclose(got, want, atol=1e-4)
    # the path matters: another root gives other logits
    assert not torch.allclose(runner.step(1, feats[0, 0], torch.tensor([[3, 4]])),
                              runner.step(1, feats[0, 0], torch.tensor([[5, 4]])))


def test_the_prefix_layer_sees_each_committed_row_once_in_order(tiny):
    """Rows fed in steps (prefill, then accepted runs of any length) give what one causal pass over the
    whole context gives; a fork starts a cache of its own."""
    heads = make_hydra(tiny, 2, prefix=True)
    runner = runner_of(tiny, heads)
    feats = torch.randn(1, 11, 64)
    with torch.no_grad():
        want = heads.context(feats)[0]
    other = runner.fork()
    assert torch.allclose(runner.begin(feats[0, :4]), want[3], atol=1e-5)
    assert torch.allclose(other.begin(feats[0, :2]), want[1], atol=1e-5)  # its own cache
    for a, b in ((4, 5), (5, 8), (8, 11)):
        assert torch.allclose(runner.extend(feats[0, a:b]), want[b - 1], atol=1e-5)
    assert runner.prefix.length == 11 and other.prefix.length == 2
    assert torch.allclose(runner.begin(feats[0, :3]), want[2], atol=1e-5)  # a new sequence starts over


def test_a_new_prefix_layer_is_the_identity(tiny):
    fresh = HydraHeads(64, 97, 2, prefix=HydraHeads.prefix_sizes(tiny.config))
    feats = torch.randn(2, 7, 64)
    assert torch.equal(fresh.context(feats), feats)
    with pytest.raises(SpecdecError, match="prefix_attention hidden_size must be the heads' 64"):
        HydraHeads(64, 97, 2, prefix={**HydraHeads.prefix_sizes(tiny.config), "hidden_size": 32})


def test_prefix_files_are_checked(tiny, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    save_medusa(make_hydra(tiny, 2, prefix=True), tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["prefix_attention"]["num_attention_heads"] == tiny.config.num_attention_heads
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "prefix_attention": 3}))
    with pytest.raises(SpecdecError, match="prefix_attention must be an object"):
        load_medusa(tmp_path / "h", cls=HydraHeads)
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    kept = {k: v for k, v in sd.items() if not k.startswith("prefix.mlp")}
    save_file(kept, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(SpecdecError, match="tensors do not match config.json.*missing \\['prefix.mlp"):
        load_medusa(tmp_path / "h", cls=HydraHeads)


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


@pytest.mark.parametrize("lm_head,reduced,prefix", [("target", False, False), ("own", True, False),
                                                    ("target", True, True)])
@pytest.mark.parametrize("tree", ["sparse", "dense"])
def test_hydra_greedy_equals_vanilla(tiny, lm_head, reduced, prefix, tree):
    heads = make_hydra(tiny, 4, 1, lm_head, torch.arange(0, 97, 2) if reduced else None, prefix=prefix)
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
@pytest.mark.parametrize("params,children,reduced,prefix", [
    (SamplingParams(1.0), "topk", False, False), (SamplingParams(1.0), "sample", False, False),
    (SamplingParams(0.8, top_k=3), "sample", False, False), (SamplingParams(1.0), "sample", True, False),
    (SamplingParams(0.9, top_p=0.8), "sample", True, True)],
    ids=["topk-T1", "sampled-T1", "sampled-T0.8-topk3", "sampled-reduced-vocab-T1", "prefix-sampled-T0.9-topp0.8"])
def test_hydra_sampling_matches_vanilla_distribution(params, children, reduced, prefix):
    """Lossless at T > 0 with top-k children and with children drawn from each parent's own head
    distribution (q over the target vocabulary, zero outside a reduced draft vocabulary), with and
    without a prefix layer."""
    model = flat_tiny()
    heads = make_hydra(model, 3, seed=3, vocab=torch.arange(0, model.config.vocab_size, 2) if reduced else None,
                       prefix=prefix)
    choices = sparse_choices([[0.5, 0.3], [0.4, 0.3], [0.3]], 5)
    drafter = HydraDrafter(runner_of(model, heads), choices, children=children)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(LeanRunner(model), drafter, prompt, params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3
