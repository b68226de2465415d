"""The tree forward equals running each root-to-node path on its own, for every runner and family."""

import pytest
import torch

from specdec.runtime.base import chain_mask, tree_mask
from specdec.runtime.hf import HFRunner
from specdec.runtime.lean import LeanRunner
from specdec.tree import DraftTree
from tests.helpers import at_threads, tiny_model

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them

RUNNERS = {"lean": LeanRunner, "lean-unpacked": lambda m: LeanRunner(m, pack=False), "hf": HFRunner}


def reference(model, ids):
    with torch.no_grad():
        out = model(torch.as_tensor(ids)[None], output_hidden_states=True)

    return out.logits[0], model.get_decoder()(torch.as_tensor(ids)[None]).last_hidden_state[0]


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_tree_forward_equals_per_path(family, runner_name):
    model = tiny_model(family)
    runner = RUNNERS[runner_name](model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (11,), generator=g)
    runner.forward(prompt)
    runner.commit(range(11))
    root = 5
    tree = DraftTree(torch.randint(0, 97, (7,), generator=g), torch.tensor([-1, 0, 0, -1, 1, 3, 4]))
    toks = torch.cat([torch.tensor([root]), tree.tokens])
    pos = runner.length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    out = runner.forward(toks, pos, tree_mask(runner.length, tree.ancestor_mask()))
    for node in range(-1, len(tree)):
        path = [] if node < 0 else tree.path_to(node)
        ids = prompt.tolist() + [root] + tree.tokens[path].tolist()
        ref_logits, ref_feats = reference(model, ids)
        torch.testing.assert_close(out.logits[node + 1], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.features[node + 1], ref_feats[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_compaction_then_continue_equals_fresh(family, runner_name):
    """Accept a non-prefix path of a tree, keep decoding: same as decoding those tokens from scratch."""
    model = tiny_model(family, seed=3)
    runner = RUNNERS[runner_name](model)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 97, (9,), generator=g)
    runner.forward(prompt)
    runner.commit(range(9))
    tree = DraftTree(torch.randint(0, 97, (6,), generator=g), torch.tensor([-1, -1, 1, 1, 3, 0]))
    root = 7
    toks = torch.cat([torch.tensor([root]), tree.tokens])
    pos = runner.length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    runner.forward(toks, pos, tree_mask(runner.length, tree.ancestor_mask()))
    path = tree.path_to(4)  # nodes 1 -> 3 -> 4: not a prefix of the flattened order
    runner.commit([0] + [i + 1 for i in path])
    nxt = torch.randint(0, 97, (3,), generator=g)
    out = runner.forward(nxt)
    ids = prompt.tolist() + [root] + tree.tokens[path].tolist() + nxt.tolist()
    ref_logits, ref_feats = reference(model, ids)
    torch.testing.assert_close(out.logits, ref_logits[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.features, ref_feats[-3:], atol=1e-4, rtol=1e-4)
    assert runner.length == 9 + 1 + len(path)


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_rows_pretended_for_timing_are_a_context_and_a_reset_forgets_them(family, runner_name):
    """pretend_cached(n) (cost probes time forwards after a long context without computing it) commits rows
    up to n, and later forwards take masks and positions after them; after a reset, a forward has a fresh
    runner's bits."""
    model = tiny_model(family)
    runner, fresh = RUNNERS[runner_name](model), RUNNERS[runner_name](model)
    runner.pretend_cached(300)
    assert runner.length == 300
    out = runner.forward(torch.tensor([1, 2, 3]), None, chain_mask(300, 3))
    assert out.logits.shape[0] == 3 and bool(torch.isfinite(out.logits).all())
    runner.rollback()
    runner.pretend_cached(480)  # extends
    assert runner.length == 480 and runner.n_pending == 0
    runner.forward(torch.tensor([4, 5]))
    runner.reset()
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(runner.forward(ids).logits, fresh.forward(ids).logits)


def test_sliding_window_matches_hf():
    model = tiny_model("mistral", sliding_window=6)
    runner = LeanRunner(model)
    ids = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(0))
    runner.forward(ids[:8])
    runner.commit(range(8))
    out = runner.forward(ids[8:])
    ref_logits, _ = reference(model, ids.tolist())
    torch.testing.assert_close(out.logits, ref_logits[-2:], atol=1e-4, rtol=1e-4)


def test_context_overflow_is_an_error():
    runner = LeanRunner(tiny_model("llama", max_position_embeddings=16))
    with pytest.raises(ValueError, match="context"):
        runner.forward(torch.zeros(17, dtype=torch.long))
