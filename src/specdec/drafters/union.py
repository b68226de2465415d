"""Several drafters at once: the target verifies the union of their trees in one forward.

A model-based tree and prompt lookup win on different tokens (the head on fresh text, lookup on text
the answer quotes or repeats), and a lookup chain costs no draft step. Every member sees every
verdict, so stateful drafters (EAGLE's head cache) stay in step. Members must draft point masses
(no q): the union of such drafts is again one, and the verifier stays exact at any temperature.
"""

from __future__ import annotations

from dataclasses import replace

from specdec.drafters.base import DecodeContext, Drafter, Drafting, alone
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.tree import DraftTree
from specdec.verify import Verdict


class UnionDrafter(Drafter):
    def __init__(self, *members: Drafter, name: str | None = None) -> None:
        if len(members) < 2:
            raise ValueError("a union needs at least two drafters")
        self.members = members
        self.name = name or "+".join(m.name for m in members)
        self.draft_depth = max((m.draft_depth or 0 for m in members), default=0) or None

    @property
    def lead(self) -> Drafter:
        return self.members[0].lead

    def fork(self) -> UnionDrafter | None:
        forks = [m.fork() for m in self.members]
        return None if None in forks else UnionDrafter(*forks, name=self.name)

    def begin(self, ctx: DecodeContext) -> None:
        for m in self.members:
            m.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return alone(self.drafting(ctx))

    def drafting(self, ctx: DecodeContext) -> Drafting:
        tree = yield from self.members[0].drafting(ctx)
        for m in self.members[1:]:
            room = ctx.max_nodes - len(tree)
            if room <= 0:
                break
            tree = tree.union((yield from m.drafting(replace(ctx, max_nodes=room))))
        return tree

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        for m in self.members:
            m.accept(ctx, verdict)

    def end(self, answer: list[int]) -> None:
        for m in self.members:
            m.end(answer)


class GreedyOnly(Drafter):
    """A member that drafts for greedy requests only. `auto` wraps its lookup chain in this: `specdec
    tune` prices the chain exactly, but for greedy decoding; sampled text repeats far less (MT-bench
    turn 1 at T=1: prompt lookup alone reached tau 1.15), so there the chain only widens the verify."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.name, self.draft_depth = inner, inner.name, inner.draft_depth

    @property
    def lead(self) -> Drafter:
        return self.inner.lead

    def fork(self) -> GreedyOnly | None:
        inner = self.inner.fork()
        return None if inner is None else GreedyOnly(inner)

    def begin(self, ctx: DecodeContext) -> None:
        self.inner.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return alone(self.drafting(ctx))

    def drafting(self, ctx: DecodeContext) -> Drafting:
        return (yield from self.inner.drafting(ctx)) if ctx.params.greedy else DraftTree.empty()

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        self.inner.accept(ctx, verdict)

    def end(self, answer: list[int]) -> None:
        self.inner.end(answer)


def with_lookup(drafter: Drafter, lookup: int, greedy_only: bool = False) -> Drafter:
    """`drafter`, plus a prompt-lookup chain of `lookup` tokens in every tree (0: unchanged)."""
    if not lookup:
        return drafter
    pld = PromptLookupDrafter(chain_len=lookup)
    return UnionDrafter(drafter, GreedyOnly(pld) if greedy_only else pld)
