"""Exact greedy replay: what the engine would accept, read off a draft tree and the target's known
greedy continuation, with no target forward. The walk is the verifier's own (verify.greedy_walk)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.tree import DraftTree
from specdec.verify import greedy_walk


def matched_path(tree: DraftTree, truth: Sequence[int]) -> list[int]:
    """The nodes greedy verification accepts when the target's next tokens are `truth`."""
    return greedy_walk(tree, lambda _, k: truth[k] if k < len(truth) else None)[0]


def replay(accepted: Sequence[int]) -> list[int]:
    """The engine's accept lengths (accepted + 1 per target forward) for a greedy generation whose
    accepted length at root position i (i = 0: the first generated token) is accepted[i]."""
    return [accepted[i] + 1 for i in visited(accepted)]


def visited(accepted: Sequence[int]) -> list[int]:
    """The root positions the engine drafts from (one target forward each)."""
    out, i = [], 0
    while i < len(accepted):
        out.append(i)
        i += accepted[i] + 1
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def union_step(accepted: int, merged: int, tree_size: int, chain: Sequence[int], truth: Sequence[int],
               lookup: int, budget: int) -> tuple[int, int]:
    """(accepted, nodes) of a tree of `tree_size` nodes joined with the first `lookup` tokens of a
    prompt-lookup chain, as UnionDrafter builds it: the chain gets the room the tree leaves, shares the
    `merged` tokens of its prefix the tree already holds, and greedy accepts the longer matched path
    (a path through both shares the chain's prefix)."""
    cut = chain[:max(0, min(lookup, budget - tree_size))]
    return max(accepted, common_prefix(cut, truth)), tree_size + len(cut) - min(merged, len(cut))
