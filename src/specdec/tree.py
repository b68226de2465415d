"""The draft tree as plain data, and the one EAGLE-2-style builder every tree drafter shares.

Nodes are stored in topological order (a parent always comes before its children); the root (the
last accepted token, not yet in the target's KV cache) is implicit and has index -1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

# a grammar's view for drafting under its mask: (a path of drafted tokens after the root, candidate tokens
# best first, k) -> the indices of the first k candidates it allows after that path
Allowed = Callable[[list[int], list[int], int], list[int]]
WIDEN = 8  # a node's children are looked for among its WIDEN * topk likeliest tokens


def allowed_prefix(allowed: Allowed | None, chain: list[int]) -> list[int]:
    """The longest prefix of a drafted chain that the grammar allows (all of it without one)."""
    if allowed is not None:
        for i, x in enumerate(chain):
            if not allowed(chain[:i], [x], 1):
                return chain[:i]
    return chain


@dataclass(frozen=True)
class TreeBudget:
    """The size of a dynamic draft tree: `depth` draft steps, `topk` children per expanded node, the
    `tree_size` nodes of highest value kept. A drafter receives it when built (or per call, as `specdec
    tune` does); nothing sets it from outside."""

    depth: int
    topk: int
    tree_size: int

    def __post_init__(self) -> None:
        for k in ("depth", "topk", "tree_size"):
            v = getattr(self, k)
            if type(v) is not int or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")

    def capped(self, max_nodes: int) -> TreeBudget:
        """Within the room left in the context (the engine's max_nodes >= 1)."""
        return TreeBudget(min(self.depth, max_nodes), self.topk, min(self.tree_size, max_nodes))


_EMPTY: dict[str, DraftTree] = {}


def children_of(parents: list[int]) -> list[list[int]]:
    """[i + 1]: node i's children in draft order; [0]: the root's (parents[i] = -1)."""
    ch: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        ch[p + 1].append(i)
    return ch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 = root
    scores: torch.Tensor | None = None  # [N] log V, V = product of draft confidences from the root
    # q each node was drawn from (given its earlier siblings); None = deterministic (point masses)
    draft_probs: torch.Tensor | None = None  # [N, V]
    depth: torch.Tensor = field(init=False)  # [N], children of the root have depth 1

    def __post_init__(self) -> None:
        self.tokens = self.tokens.long().reshape(-1)
        self.parents = self.parents.long().reshape(-1)
        if self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must have the same length")
        par = self.parents.tolist()
        depth = []
        for i, p in enumerate(par):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must be in topological order")
            depth.append(1 if p < 0 else depth[p] + 1)
        self.depth = torch.tensor(depth, dtype=torch.long)
        self._parents = par

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        """The tree of no nodes, one per device (trees are never changed in place). Why shared: a plain
        step of `auto` builds several, ~50 us each on the CPU, paid on every step that drafts nothing."""
        key = str(device)
        tree = _EMPTY.get(key)
        if tree is None:
            e = torch.zeros(0, dtype=torch.long, device=device)
            tree = _EMPTY[key] = cls(e, e.clone())
        return tree

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        return cls(tokens, torch.arange(-1, n - 1, device=tokens.device), draft_probs=draft_probs)

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self) else 0

    def children(self) -> list[list[int]]:
        return children_of(self._parents)

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes): row i sees column j iff j is i itself or an ancestor."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        for i, p in enumerate(self._parents):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self._parents[node]
        return path[::-1]

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than max_depth (e.g. near the context limit); keeps the order."""
        keep = (self.depth <= max_depth).nonzero().flatten()
        return self.select(keep)

    def union(self, other: DraftTree) -> DraftTree:
        """This tree plus `other`'s paths, shared prefixes merged (no two siblings carry the same token).
        Only for deterministic trees (no q): a union of point-mass drafts is still one, so the verifier
        stays exact. Scores survive only if both trees have them."""
        if self.draft_probs is not None or other.draft_probs is not None:
            raise ValueError("only deterministic draft trees (draft_probs None) can be merged")
        toks, pars = self.tokens.tolist(), list(self._parents)
        child = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks))}
        where: list[int] = []
        for t, p in zip(other.tokens.tolist(), other._parents):
            key = (-1 if p < 0 else where[p], t)
            if key not in child:
                child[key] = len(toks)
                toks.append(t)
                pars.append(key[0])
            where.append(child[key])
        if len(toks) == len(self):
            return self
        scores = None
        if self.scores is not None and other.scores is not None:
            s = torch.full((len(toks),), float("-inf"), dtype=self.scores.dtype)
            s[: len(self)] = self.scores.cpu()
            for j, i in enumerate(where):  # a node both trees drafted keeps the higher score
                s[i] = max(float(s[i]), float(other.scores[j]))
            scores = s.to(self.scores.device)
        dev = self.tokens.device
        return DraftTree(torch.tensor(toks, device=dev), torch.tensor(pars, device=dev), scores)

    def select(self, keep: torch.Tensor) -> DraftTree:
        """Sub-tree of the given node indices (sorted, closed under parents)."""
        keep = keep.to(torch.long).cpu()
        remap = {-1: -1}
        for new, old in enumerate(keep.tolist()):
            remap[old] = new
        parents = torch.tensor([remap[self._parents[k]] for k in keep.tolist()], dtype=torch.long)
        dev = self.tokens.device
        return DraftTree(
            self.tokens[keep.to(dev)],
            parents.to(dev),
            None if self.scores is None else self.scores[keep.to(self.scores.device)],
            None if self.draft_probs is None else self.draft_probs[keep.to(self.draft_probs.device)],
        )


# step(new_nodes [k], tokens [n], parents [n]) -> log-probabilities [k, V] of each new node's children.
# Lists of ints: `tokens`/`parents` describe every node made so far; the callee owns its KV cache and has
# already cached the nodes of earlier calls (see NodeSlots).
StepFn = Callable[[list[int], list[int], list[int]], torch.Tensor]
# A tree being built: it yields each step's arguments and is sent the step's result (a drafter runs the
# step's forward between, alone or packed with other sequences' drafts: drafters.base.Drafting).
Growing = Generator[tuple[list[int], list[int], list[int]], torch.Tensor, "DraftTree"]


def grown(tree: Growing, step: StepFn) -> DraftTree:
    """The tree, each step run by `step`."""
    try:
        args = next(tree)
        while True:
            args = tree.send(step(*args))
    except StopIteration as done:
        return done.value


def grow(tree: Growing, step: Callable[..., Generator]) -> Generator:
    """The tree, each step run by the generator `step` (a drafter's: it yields the forwards it needs)."""
    try:
        args = next(tree)
    except StopIteration as done:
        return done.value
    while True:
        out = yield from step(*args)
        try:
            args = tree.send(out)
        except StopIteration as done:
            return done.value


class NodeSlots:
    """Maps tree nodes to the uncommitted KV-cache slots a drafter wrote them to, and builds masks."""

    def __init__(self) -> None:
        self.slot: dict[int, int] = {}

    def mask(self, new_nodes: list[int], parents: list[int], n_committed: int) -> torch.Tensor:
        """[k, n_committed + len(slots) + k] bool: committed prefix + each node's cached ancestors + itself."""
        n_old = len(self.slot)
        m = torch.zeros(len(new_nodes), n_committed + n_old + len(new_nodes), dtype=torch.bool)
        m[:, :n_committed] = True
        for r, node in enumerate(new_nodes):
            m[r, n_committed + n_old + r] = True
            p = parents[node]
            while p >= 0:
                m[r, n_committed + self.slot[p]] = True
                p = parents[p]
        for r, node in enumerate(new_nodes):
            self.slot[node] = n_old + r
        return m


def build_dynamic_tree(root_logprobs: torch.Tensor, step: StepFn, depth: int, topk: int, tree_size: int,
                       rank_by: str = "value", rerank: bool = True, allowed: Allowed | None = None) -> DraftTree:
    """dynamic_tree with each depth's nodes expanded by `step`."""
    return grown(dynamic_tree(root_logprobs, depth, topk, tree_size, rank_by, rerank, allowed), step)


def dynamic_tree(
    root_logprobs: torch.Tensor,
    depth: int,
    topk: int,
    tree_size: int,
    rank_by: str = "value",
    rerank: bool = True,
    allowed: Allowed | None = None,
) -> Growing:
    """EAGLE-2 context-aware draft tree.

    Expansion: at each depth keep the top-k nodes of the newest layer by value V (product of
    confidences along the path) or by their own confidence (ablation), run one `step` for all of
    them, and give each its top-k children. Reranking: keep the tree_size nodes of highest V
    (ties -> shallower; V never grows along a path so the kept set is connected); without reranking
    the draft is the nodes chosen for expansion at each depth, shallow first. With `allowed` (a
    grammar) a node's children are its top-k tokens the grammar allows after its path: the draft is
    proposed under the mask, and a forbidden token takes no node.

    The bookkeeping is on Python lists: a draft tree has tens of nodes, where each small tensor op
    costs more than the whole list operation (and this runs once per decoding step)."""
    if rank_by not in ("value", "confidence"):
        raise ValueError("rank_by must be 'value' or 'confidence'")
    topk = min(topk, root_logprobs.shape[-1])
    if rank_by == "value" and rerank:  # a kept node's ancestors and elder siblings are kept: no more is needed
        topk, depth = min(topk, tree_size), min(depth, tree_size)
    lp, tok = _children(root_logprobs[None], topk, [[]], allowed)
    toks, pars, vs = tok[0].tolist(), [-1] * topk, lp[0].tolist()  # vs: log V, float32 values
    # with a grammar: each node's tokens from the root's child down
    paths = [[t] for t in toks] if allowed is not None else []
    frontier, conf = list(range(topk)), vs  # the newest layer and its nodes' own confidences
    expanded: list[list[int]] = []
    for d in range(1, depth + 1):
        key = [vs[i] for i in frontier] if rank_by == "value" else conf
        best = sorted(range(len(frontier)), key=key.__getitem__, reverse=True)[:topk]
        sel = sorted(frontier[i] for i in best)
        if allowed is not None:  # a token the grammar forbids is no node
            sel = [i for i in sel if vs[i] != -math.inf]
            if not sel:
                break
        expanded.append(sel)
        if d == depth:
            break
        # the step sees only the nodes it has not seen; the selected frontier is new to it
        child_lp = yield sel, toks, pars
        c_lp, c_tok = _children(child_lp, topk, [paths[i] for i in sel] if allowed else [], allowed)  # [k, topk]
        c_tok_l = c_tok.tolist()
        if allowed is not None:
            paths += [paths[i] + [t] for i, row in zip(sel, c_tok_l) for t in row]
        v = torch.tensor([vs[i] for i in sel], dtype=c_lp.dtype, device=c_lp.device)[:, None] + c_lp  # float32
        frontier = list(range(len(toks), len(toks) + len(sel) * topk))
        toks = toks + [t for row in c_tok_l for t in row]
        pars = pars + [i for i in sel for _ in range(topk)]
        vs = vs + v.flatten().tolist()
        conf = c_lp.flatten().tolist()
    m = min(tree_size, len(toks) if allowed is None else sum(x != -math.inf for x in vs))
    if rerank:
        # a stable sort: ties keep index order, i.e. shallower first; since V never grows along a
        # path, every kept node's parent ranks before it and the kept set is connected
        keep = sorted(range(len(vs)), key=lambda i: -vs[i])[:m]
    else:  # ablation: the draft is just the nodes chosen during expansion (a beam per depth)
        keep = [i for s in expanded for i in s][:m]
    keep.sort()
    new = {-1: -1} | {old: i for i, old in enumerate(keep)}
    dev = root_logprobs.device
    return DraftTree(torch.tensor([toks[i] for i in keep], device=dev),
                     torch.tensor([new[pars[i]] for i in keep], device=dev),
                     torch.tensor([vs[i] for i in keep], dtype=lp.dtype, device=dev))


def _children(logprobs: torch.Tensor, k: int, paths: list[list[int]], allowed: Allowed | None):
    """Each row's k best children (log-probs, tokens [R, k]); with a grammar, the k best it allows after the
    row's path, found among the row's WIDEN * k best tokens (fewer: -inf log-probs fill the row)."""
    if allowed is None:
        return torch.topk(logprobs.float(), k, dim=-1)
    c_lp, c_tok = torch.topk(logprobs.float(), min(k * WIDEN, logprobs.shape[-1]), dim=-1)
    lp = c_lp.new_full((logprobs.shape[0], k), float("-inf"))
    tok = c_tok.new_zeros(logprobs.shape[0], k)
    for r, (path, row) in enumerate(zip(paths, c_tok.tolist())):
        idx = torch.tensor(allowed(path, row, k), dtype=torch.long, device=c_tok.device)
        lp[r, : idx.numel()], tok[r, : idx.numel()] = c_lp[r, idx], c_tok[r, idx]
    return lp, tok


def draw_children(logp: torch.Tensor, k: int, generator: torch.Generator | None):
    """k children per row of logp [R, V], drawn without replacement from softmax(logp) in draw order
    (Gumbel-top-k: the k largest logp + Gumbel noise are an ordered sample without replacement), and
    the q each was drawn from: softmax(logp) without its elder siblings, renormalised (what the verifier's
    recursive rejection needs). Returns (logp of the drawn tokens [R, k], tokens [R, k], q [R, k, V],
    ok [R, k]); ok is False past a row's support (a tiny temperature leaves one token), where no draw exists."""
    logp = logp.float()
    k = min(k, logp.shape[-1])
    u = torch.rand(logp.shape, generator=generator, device=logp.device).clamp_(min=1e-30)
    tok = torch.topk(logp - torch.log(-torch.log(u)), k, dim=-1).indices
    drawn = torch.zeros(logp.shape[0], k, logp.shape[-1], dtype=torch.bool, device=logp.device)
    for j in range(1, k):
        drawn[:, j] = drawn[:, j - 1]
        drawn[:, j].scatter_(1, tok[:, j - 1 : j], True)
    q = logp.exp().unsqueeze(1).masked_fill(drawn, 0.0)
    mass = q.sum(-1, keepdim=True)
    q = q / mass.clamp_min(torch.finfo(q.dtype).tiny)
    ok = (mass[..., 0] > 0) & (q.gather(-1, tok.unsqueeze(-1))[..., 0] > 0)
    return logp.gather(-1, tok), tok, q, ok


def build_sampled_tree(root_logprobs: torch.Tensor, step: StepFn, depth: int, topk: int, tree_size: int,
                       generator: torch.Generator | None) -> DraftTree:
    """sampled_tree with each depth's nodes expanded by `step`."""
    return grown(sampled_tree(root_logprobs, depth, topk, tree_size, generator), step)


def sampled_tree(
    root_logprobs: torch.Tensor, depth: int, topk: int, tree_size: int, generator: torch.Generator | None,
) -> Growing:
    """EAGLE-2's expansion with sampled children (T > 0): at each depth the top-k nodes of the newest
    layer by value V are expanded, best first, and each gets k children drawn without replacement from
    the draft distribution (fewer where its support is smaller); the draft is the first tree_size nodes
    in that order.

    Why no value reranking: a node kept or pruned by its own sampled value is no longer distributed as
    the q the verifier divides by. Here whether a node exists, and where, is settled before it is drawn
    (by its parent's rank and its q's support), so recursive rejection against each child's q stays exact."""
    lp, tok, q, ok = draw_children(root_logprobs[None], topk, generator)
    tokens, parents, logv, qs = [tok[ok]], [torch.full_like(tok[ok], -1)], [lp[ok]], [q[ok]]
    n = tokens[0].numel()
    frontier_ids, frontier_v = torch.arange(n, device=tok.device), logv[0]
    for _ in range(1, depth):
        if n >= tree_size or frontier_v.numel() == 0:
            break
        best = torch.topk(frontier_v, min(topk, frontier_v.numel())).indices  # by value, best first
        sel = frontier_ids[best]
        order = torch.argsort(sel)  # the step takes the new nodes in index order (topological)
        asked = sel[order].tolist(), torch.cat(tokens).tolist(), torch.cat(parents).tolist()
        rows = (yield asked)[torch.argsort(order)]
        lp, tok, q, ok = draw_children(rows, topk, generator)
        v = torch.cat(logv)[sel].unsqueeze(1) + lp
        # boolean indexing flattens row by row: best parent first, each parent's children in draw order
        tokens.append(tok[ok])
        parents.append(sel.unsqueeze(1).expand_as(tok)[ok])
        logv.append(v[ok])
        qs.append(q[ok])
        frontier_ids = torch.arange(n, n + tokens[-1].numel(), device=tok.device)
        frontier_v = logv[-1]
        n += tokens[-1].numel()
    m = min(tree_size, n)
    return DraftTree(torch.cat(tokens)[:m], torch.cat(parents)[:m], torch.cat(logv)[:m], torch.cat(qs)[:m])


def check_choices(choices: Sequence[Sequence[int]]) -> list[tuple]:
    """Rank paths (EAGLE-1's and Medusa's static trees: (0, 1) = the best node's 2nd-ranked child) in
    tree order; a ValueError saying "must ..." when they do not make a tree."""
    ordered = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if not ordered or any(len(c) == 0 or min(c) < 0 for c in ordered):
        raise ValueError(f"must be non-empty lists of ranks >= 0, e.g. [[0], [1], [0, 0]], got {choices!r}")
    have = set(ordered)
    for c in ordered:
        if len(c) > 1 and c[:-1] not in have:
            raise ValueError(f"must hold every path's parent: {list(c)} needs its parent {list(c[:-1])}")
    return ordered
