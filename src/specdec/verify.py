"""Lossless verification of a draft tree against the target's logits (docs/design.md, "Lossless acceptance").

logits row 0 belongs to the root, row i + 1 to tree node i. The verifier never knows which drafter
made the tree: it only reads tokens, parents and (for sampled drafts) the proposal distributions q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.sampling import Coupling, SamplingParams, argmax_rows, probs_from_logits, sample
from specdec.tree import DraftTree


@dataclass(frozen=True)
class Typical:
    """Medusa's typical acceptance (LOSSY, opt-in): a draft token x is accepted where the target's
    p(x) > min(epsilon, delta * exp(-H(p))); the longest accepted path wins; at T = 0 it is greedy."""

    epsilon: float = 0.09
    delta: float = 0.3

    def __str__(self) -> str:
        return f"typical(epsilon={self.epsilon:g}, delta={self.delta:g})"


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, root to leaf
    tokens: list[int]  # their tokens followed by the bonus token
    bonus: int


def verify(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    typical: Typical | None = None, coupling: Coupling | None = None, position: int = 0,
) -> Verdict:
    """Lossless unless `typical` is given (then lossy at T > 0). coupling: a seeded request's draws, row 0
    predicting the token at `position` (its index in prompt + answer)."""
    if params.greedy:
        return _verify_greedy(tree, logits)
    if coupling is not None and typical is None:
        return _verify_coupled(tree, logits, params, coupling, position)
    if typical is not None:
        return _verify_typical(tree, probs_from_logits(logits, params), generator, typical)
    return _verify_stochastic(tree, probs_from_logits(logits, params), generator)


def greedy_walk(tree: DraftTree, want: Callable[[int, int], int | None]) -> tuple[list[int], int]:
    """From the root, follow the child whose token is want(row, accepted so far) until none matches or
    want says None. Siblings carry distinct tokens, so the path is unique. Returns (path, last row)."""
    toks, children = tree.tokens.tolist(), tree.children()
    path: list[int] = []
    row = 0
    while (x := want(row, len(path))) is not None:
        nxt = next((c for c in children[row] if toks[c] == x), None)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt + 1
    return path, row


def _verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    best = argmax_rows(logits)
    path, row = greedy_walk(tree, lambda r, _: best[r])
    toks = tree.tokens.tolist()
    return Verdict(path, [toks[i] for i in path] + [best[row]], best[row])


def _verify_coupled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, coupling: Coupling,
                    position: int) -> Verdict:
    """The greedy walk with the target's coupled draw in place of its argmax: a node at depth d is
    accepted iff its token is the draw at position + d - 1 from its parent's row. Only visited rows are
    drawn. Exact: the emitted token at each position is the target's draw there, whatever was drafted."""
    drawn: dict[int, int] = {}

    def draw(row: int, k: int) -> int:
        if row not in drawn:
            drawn[row] = coupling.pick(probs_from_logits(logits[row], params), position + k)
        return drawn[row]

    path, row = greedy_walk(tree, draw)
    toks = tree.tokens.tolist()
    bonus = draw(row, len(path))
    return Verdict(path, [toks[i] for i in path] + [bonus], bonus)


def _verify_stochastic(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling: exact for chains, sampled siblings and point-mass (top-k) siblings."""
    toks = tree.tokens.tolist()
    children = tree.children()
    # one batch of uniforms up front: a single host sync instead of one per tried node
    u = torch.rand(len(tree) + 1, generator=generator, device=probs.device).tolist()
    path: list[int] = []
    row = 0
    p = probs[0]
    while True:
        accepted = None
        for c in children[row]:
            x = toks[c]
            if tree.draft_probs is None:  # point mass q = delta_x
                px = float(p[x])
                if u[c] < px:
                    accepted = c
                    break
                p = p.clone()
                p[x] = 0.0
            else:
                q = tree.draft_probs[c].to(p.dtype)
                px, qx = float(p[x]), float(q[x])
                if qx > 0 and u[c] * qx < px:  # u < min(1, p/q)
                    accepted = c
                    break
                p = torch.clamp(p - q, min=0.0)
            s = float(p.sum())
            if s <= 0:  # p was entirely covered by q: cannot happen after a rejection in exact arithmetic
                p = probs[row]
                s = float(p.sum())
            p = p / s
        if accepted is None:
            break
        path.append(accepted)
        row = accepted + 1
        p = probs[row]
    bonus = sample(p, generator)
    return Verdict(path, [toks[i] for i in path] + [bonus], bonus)


def _verify_typical(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None, rule: Typical) -> Verdict:
    """The deepest node whose whole path passes p(x) > min(epsilon, delta exp(-H(p))) at each parent's row
    (ties: the earliest in draft order); the bonus is sampled from the target at that node's row."""
    logp = torch.log(probs.clamp_min(1e-38))
    entropy = -(probs * logp).sum(-1)
    thresh = torch.minimum(torch.full_like(entropy, rule.epsilon), rule.delta * torch.exp(-entropy))
    par, toks = tree.parents.tolist(), tree.tokens.tolist()
    rows = tree.parents.to(probs.device) + 1  # each node's token is judged at its parent's row
    ok = (probs[rows, tree.tokens.to(probs.device)] > thresh[rows]).tolist()
    depth, best = [0] * len(tree), -1
    for i, p in enumerate(par):  # topological order: a parent's verdict is known before its children
        live = ok[i] and (p < 0 or depth[p] > 0)
        depth[i] = (1 if p < 0 else depth[p] + 1) if live else 0
        if live and (best < 0 or depth[i] > depth[best]):
            best = i
    path: list[int] = []
    while best >= 0:
        path.append(best)
        best = par[best]
    path.reverse()
    row = path[-1] + 1 if path else 0
    bonus = sample(probs[row], generator)
    return Verdict(path, [toks[i] for i in path] + [bonus], bonus)
