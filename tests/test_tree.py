import pytest
import torch

from specdec.tree import DraftTree, NodeSlots, build_dynamic_tree


def test_depth_children_and_ancestor_mask():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 1]))
    assert t.depth.tolist() == [1, 2, 1, 3]
    assert t.children() == [[0, 2], [1], [3], [], []]
    m = t.ancestor_mask()
    assert m.shape == (5, 5)
    assert m[4].tolist() == [True, True, True, False, True]  # node 3 sees root, 0, 1, itself
    assert m[3].tolist() == [True, False, False, True, False]
    assert t.path_to(3) == [0, 1, 3]


def test_parents_must_be_topological():
    with pytest.raises(ValueError, match="topological"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


def test_select_remaps_parents():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 1]))
    s = t.select(torch.tensor([0, 1, 3]))
    assert s.tokens.tolist() == [5, 6, 8] and s.parents.tolist() == [-1, 0, 1]


def _table_step(table):
    """A drafter whose child log-probs depend only on the parent token (a hand-made confidence table)."""
    def step(sel, tokens, parents):
        return torch.stack([table[int(tokens[i])] for i in sel])
    return step


def _table(vocab, rows):
    t = torch.full((vocab, vocab), 1e-6)
    for parent, probs in rows.items():
        for tok, p in probs.items():
            t[parent, tok] = p
    return (t / t.sum(-1, keepdim=True)).log()


def test_value_ranking_expands_by_path_product():
    # root: token 1 (0.6) or 2 (0.4). After 1 the next token is uncertain, after 2 it is certain:
    # by value (product) 2 -> 3 (0.4 * 0.99) beats 1 -> 4 (0.6 * 0.5)
    table = _table(8, {1: {4: 0.5, 5: 0.5}, 2: {3: 0.99}, 3: {6: 0.9}, 4: {7: 0.9}, 5: {7: 0.9}})
    root = torch.log(torch.tensor([0.0, 0.6, 0.4, 0, 0, 0, 0, 0]) + 1e-9)
    tree = build_dynamic_tree(root, _table_step(table), depth=3, topk=1, tree_size=3)
    # topk=1 per level: the beam follows the best node by value at each depth
    assert tree.tokens.tolist() == [1, 4, 7]  # greedy beam from the top root child
    tree = build_dynamic_tree(root, _table_step(table), depth=3, topk=2, tree_size=3)
    # reranked top-3 by value: 1 (0.6), 2 (0.4), 2->3 (0.396)
    assert sorted(tree.tokens.tolist()) == [1, 2, 3]
    assert tree.parents[tree.tokens.tolist().index(3)].item() == tree.tokens.tolist().index(2)


def test_confidence_ranking_differs_from_value():
    table = _table(8, {1: {4: 0.5, 5: 0.5}, 2: {3: 0.99}, 3: {6: 0.99}, 4: {7: 0.6}, 5: {6: 0.6}})
    root = torch.log(torch.tensor([0.0, 0.9, 0.1, 0, 0, 0, 0, 0]) + 1e-9)
    seen = {}
    for rank_by in ("value", "confidence"):
        expanded = []

        def step(sel, tokens, parents, expanded=expanded):
            expanded.append([tokens[i] for i in sel])
            return _table_step(table)(sel, tokens, parents)
        build_dynamic_tree(root, step, depth=3, topk=2, tree_size=10, rank_by=rank_by)
        seen[rank_by] = expanded
    # depth 2 layer: children 1->4 (V .45), 1->5 (.45), 2->3 (V .099 but confidence .99)
    assert 3 not in seen["value"][1] and 3 in seen["confidence"][1]


def test_rerank_keeps_tree_connected_and_prefers_shallow_ties():
    torch.manual_seed(0)
    vocab = 16
    table = torch.log_softmax(torch.randn(vocab, vocab) * 2, -1)
    root = torch.log_softmax(torch.randn(vocab) * 2, -1)
    for total in range(1, 20):
        tree = build_dynamic_tree(root, _table_step(table), depth=4, topk=3, tree_size=total)
        assert len(tree) == min(total, 3 + 9 + 9 + 9)
        par = tree.parents.tolist()
        assert all(p < i for i, p in enumerate(par))  # connected, topological (DraftTree checks too)
        # every node's value is <= its parent's
        v = tree.scores.tolist()
        assert all(p < 0 or v[i] <= v[p] + 1e-6 for i, p in enumerate(par))
    # exact ties: a certain child (log 1 = 0) ties its parent; the parent (shallower) must win
    table = torch.full((4, 4), float("-inf"))
    table[:, 3] = 0.0
    root = torch.log(torch.tensor([0.5, 0.5, 0.0, 0.0]))
    tree = build_dynamic_tree(root, _table_step(table), depth=3, topk=2, tree_size=2)
    assert tree.depth.tolist() == [1, 1]


def test_no_rerank_keeps_expanded_beam():
    torch.manual_seed(1)
    table = torch.log_softmax(torch.randn(10, 10) * 3, -1)
    root = torch.log_softmax(torch.randn(10) * 3, -1)
    tree = build_dynamic_tree(root, _table_step(table), depth=3, topk=2, tree_size=100, rerank=False)
    assert tree.depth.tolist() == [1, 1, 2, 2, 3, 3]


def test_node_slots_mask():
    slots = NodeSlots()
    parents = [-1, -1, 0, 0, 2]
    m1 = slots.mask([0, 1], parents, n_committed=3)
    assert m1.tolist() == [[True] * 3 + [True, False], [True] * 3 + [False, True]]
    m2 = slots.mask([2, 3], parents, 3)
    assert m2[0].tolist() == [True] * 3 + [True, False, True, False]
    m3 = slots.mask([4], parents, 3)
    assert m3[0].tolist() == [True] * 3 + [True, False, True, False, True]


def _path_step(vocab, seed):
    """A drafter whose child log-probs are a random function of the node's whole path."""
    def step(sel, tokens, parents):
        rows = []
        for i in sel:
            path = []
            while i >= 0:
                path.append(int(tokens[i]))
                i = int(parents[i])
            g = torch.Generator().manual_seed(hash((seed, *path)) % (1 << 31))
            rows.append(torch.log_softmax(3 * torch.randn(vocab, generator=g), -1))
        return torch.stack(rows)
    return step


def _paths(tree: DraftTree) -> dict[tuple, float]:
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path_to(i)): round(float(tree.scores[i]), 5) for i in range(len(tree))}


@pytest.mark.parametrize("seed", range(6))
def test_a_grammar_drafts_the_tree_its_mask_would(seed):
    """Drafting under a grammar (each node's children among what it allows after the node's path) is the tree
    drafted from log-probs masked by the grammar at every node, less the masked nodes; no node is forbidden."""
    vocab = 10  # fewer than WIDEN * topk: every allowed token is within reach

    def ok(path, x):
        return (x + 2 * len(path) + sum(path)) % 3 != 0 and not (seed % 2 and path == [] and x % 2)

    def allowed(path, candidates, k):
        return [i for i, x in enumerate(candidates) if ok(path, x)][:k]

    def masked(step):
        def inner(sel, tokens, parents):
            lp = step(sel, tokens, parents).clone()
            for r, i in enumerate(sel):
                path = []
                while i >= 0:
                    path.insert(0, int(tokens[i]))
                    i = int(parents[i])
                lp[r, [x for x in range(vocab) if not ok(path, x)]] = float("-inf")
            return lp
        return inner

    g = torch.Generator().manual_seed(seed)
    root = torch.log_softmax(3 * torch.randn(vocab, generator=g), -1)
    root_masked = root.masked_fill(torch.tensor([not ok([], x) for x in range(vocab)]), float("-inf"))
    for depth, topk, size in ((3, 2, 6), (4, 3, 12), (2, 4, 20)):
        step = _path_step(vocab, seed)
        under = build_dynamic_tree(root, step, depth, topk, size, allowed=allowed)
        want = build_dynamic_tree(root_masked, masked(step), depth, topk, size)
        want_paths = {p: v for p, v in _paths(want).items() if v != float("-inf")}
        assert _paths(under) == want_paths and len(under) > 0
        assert all(ok(list(p[:-1]), p[-1]) for p in _paths(under))
        free = build_dynamic_tree(root, step, depth, topk, size)
        assert any(not ok(list(p[:-1]), p[-1]) for p in _paths(free))  # the grammar did shape the draft
