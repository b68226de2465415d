"""`auto`'s drafter: every step it looks up an n-gram draft, then verifies what policy.py finds paying most
(a model's draft, an n-gram prefix, their union, or nothing) under costs fixed within a request and
rescaled between requests where the steps drifted from them (clock.StepClock). Every n-gram draft is
scored on the tokens emitted after it, verified or not: a plain stretch still learns when the text starts
repeating. No text depends on these choices (greedy: the target's argmax; seeded sampling: its coupled
draws); a draft carrying q (sampled children or chain) never shares a verify with point masses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.drafters.base import DecodeContext, Drafter, Drafting, TreeDrafter, alone
from specdec.drafters.clock import PRICED_ROWS, CatchUp, StepClock
from specdec.drafters.costs import Costs
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.policy import HURDLE, Beyond, Calibration, ChainRate, Choice, Policy, TreeScale
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.tree import DraftTree, TreeBudget, children_of
from specdec.verify import Verdict, greedy_walk

# a point mass at T > 0 is accepted with p(x), not whenever it is the argmax (the shipped head: alpha_1
# 0.35 at T = 1 vs 0.64 greedy): scales a head's greedy table without a sampled one, and n-gram confidences
SAMPLED_SCALE = 0.55
DRAFT_ALPHA, DRAFT_ALPHA_SAMPLED = 0.7, 0.5  # a draft model's prior per-token acceptance, greedy and T > 0
MAX_PENDING = 8  # n-gram drafts followed at once past the step that drafted them


def matched(tree: DraftTree, tokens: list[int]) -> int:
    """How far the emitted tokens follow a path of `tree`: its accepted length (a rejected child is never
    emitted: the residual max(0, p - q) has no mass there)."""
    return len(greedy_walk(tree, lambda _, k: tokens[k] if k < len(tokens) else None)[0])


def tried(children: list[list[int]], tokens: list[int], emitted: list[int]) -> tuple[list[tuple[int, bool]], bool]:
    """The nodes the emitted tokens tested (the children of the root and of each matched node), whether
    each was emitted, and whether the walk is over (a miss or a leaf) rather than waiting for tokens."""
    out: list[tuple[int, bool]] = []
    row = 0
    for x in emitted:
        if not children[row]:
            return out, True
        hit = None
        for c in children[row]:
            out.append((c, tokens[c] == x))
            if tokens[c] == x:
                hit = c
        if hit is None:
            return out, True
        row = hit + 1
    return out, not children[row]


@dataclass
class NgramDraft:
    """A step's n-gram draft as the policy reads it, and as it is scored on the tokens emitted after it."""

    tokens: list[int]
    parents: list[int]
    confs: list[float]  # each node's raw confidence given its parent
    start: int  # len(ctx.tokens) when drafted: it guesses ctx.tokens[start:]
    tree: DraftTree | None = None  # None: a chain, built when verified
    model: int | None = None  # what the model draft verified on the same step matched (None: none)
    _children: list[list[int]] | None = None

    def part(self, n: int) -> DraftTree:
        """Its first n nodes (best first: a tree)."""
        if self.tree is None:
            return DraftTree.chain(torch.tensor(self.tokens[:n], dtype=torch.long))
        return self.tree.select(torch.arange(n))

    def children(self) -> list[list[int]]:
        if self._children is None:
            self._children = children_of(self.parents)
        return self._children


@dataclass
class AdaptiveDrafter(Drafter):
    """model: an EAGLE head (menu: its trees, from the tuning table) or a draft model (menu: its chains);
    ngram: a prompt-lookup chain (cheapest: beside a head) or an n-gram tree (SuffixDecoding-style)."""

    costs: Costs
    model: TreeDrafter | None = None
    menu: list[tuple[TreeBudget, float]] = field(default_factory=list)  # (budget, prior expected accepted tokens)
    ngram: PromptLookupDrafter | NgramDrafter | None = None
    # T > 0 with a head: trees with children drawn from the draft (eagle's children="sample"), priced by
    # costs.sampled_s from the head's sampled acceptance table
    sampled: list[tuple[TreeBudget, float]] | None = None
    # the n-gram calibration's measured priors ({"greedy"|"sampled": one share per bucket}, tuning.load_lookup_rates)
    lookup_rates: dict[str, list[float | None]] | None = None
    clock: StepClock | None = None  # None: the costs stay as given
    origin: str = "given"  # how the costs were obtained ("cached", "measured at load in 3.1 s")
    cache: Path | None = None  # the cost file they came from
    choices: Counter = field(default_factory=Counter)  # this request's verified draft sizes (bench, tests)

    def __post_init__(self) -> None:
        self.head: EagleDrafter | None = self.model if self.model is not None and self.model.reads_features else None
        if self.model is None and self.ngram is None:
            raise ValueError("adaptive drafting needs a model or an n-gram drafter")
        if (self.model is None) != (not self.menu):
            raise ValueError("a menu needs a model, and only then")
        if (self.sampled is not None) != (self.head is not None and self.head.children == "sample"):
            raise ValueError("a sampled menu needs an EAGLE drafter with children='sample', and only then")
        self.aux_layers = self.model.aux_layers if self.model is not None else ()
        self.draft_depth = max([b.depth for b, _ in [*self.menu, *(self.sampled or [])]] +
                               [self.ngram.draft_depth if self.ngram is not None else 0])
        if self.head is not None:
            kind = "eagle3" if self.head.aux_layers else "eagle2"
            self.name = f"{kind}+{self.ngram.name} adaptive" if self.ngram is not None else f"{kind} adaptive"
        else:
            parts = (["ngram"] if self.ngram is not None else []) + (["sps"] if self.model is not None else [])
            self.name = "+".join(parts) + " adaptive (auto, no head)"
        self.catch = CatchUp(self.costs.catch_row_s)  # measured at load, then learned over requests
        self.relearned, self.rows, self.rows_ctx = 0, 0, 0
        self.pending: list[NgramDraft] = []
        self.last: tuple | None = None

    def fork(self) -> AdaptiveDrafter | None:
        """Another sequence of a batch, priced by these costs as they stand and never learning prices (no
        clock: in a batch a sequence's forward_s times the whole packed forward)."""
        model = self.model.fork() if self.model is not None else None
        if self.model is not None and model is None:
            return None
        ngram = self.ngram.fork() if self.ngram is not None else None
        return replace(self, model=model, ngram=ngram, clock=None, choices=Counter())

    @property
    def lead(self) -> Drafter:
        return self.head if self.head is not None else self

    @property
    def costs_source(self) -> str:
        return f"{self.origin}, then learned online ({self.relearned}x)" if self.relearned else self.origin

    def prepare(self) -> None:
        """Between requests: prices rescaled to the observed steps if they drifted from them."""
        if self.clock is None:
            return
        self.clock.settle(self.costs.target)
        if self.clock.drifted:
            self.costs = self.costs.rescaled(self.clock.factors(), self.clock.draft_factor())
            self.clock = self.clock.restarted()
            self.relearned += 1

    def begin(self, ctx: DecodeContext) -> None:
        greedy = ctx.params.greedy
        if self.head is not None and not greedy and self.sampled is not None:
            self.policy = Policy(self.sampled, self.costs, draft_s=self.costs.sampled_s, union=False, hurdle=HURDLE)
        elif self.head is not None:
            self.policy = Policy(self.menu, self.costs, hurdle=HURDLE)
        else:  # a draft model's sampled chain carries q: no union with point masses
            self.policy = Policy(self.menu, self.costs, union=greedy)
        self.scale = TreeScale(SAMPLED_SCALE if self.head is not None and not greedy and self.sampled is None else 1.0)
        self.rate = ChainRate(DRAFT_ALPHA if greedy else DRAFT_ALPHA_SAMPLED)
        if self.head is None and self.menu:
            self.policy.regain(self.rate.gains(self.menu))
        rates = (self.lookup_rates or {}).get("greedy" if greedy else "sampled")
        self.cal, self.beyond = Calibration(1.0 if greedy else SAMPLED_SCALE, rates), Beyond()
        self.sharing, self.pending, self.last, self.rows = 1, [], None, 0
        self.choices = Counter()
        # whether reading the prompt into a draft model was weighed yet (a head reads it lazily, see eagle.py)
        self.weighed = self.head is not None or self.model is None
        for d in (self.model, self.ngram):
            if d is not None:
                d.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return alone(self.drafting(ctx))

    def drafting(self, ctx: DecodeContext) -> Drafting:
        if ctx.sharing != self.sharing:  # a batch's rows share each forward: price this sequence's share
            self.sharing = ctx.sharing
            self.policy.reprice(self.costs.shared(ctx.sharing))
        room, n_ctx = ctx.max_nodes, len(ctx.tokens)
        if not self.weighed:
            self.weighed = True
            if not self.reading_pays(ctx):  # this request drafts without the draft model
                self.policy = Policy([], self.policy.costs, union=False)
        ng = self._ngram(ctx) if room > 0 else None
        gains = self.cal.gains(ng.confs, ng.parents) if ng is not None else []
        look = self.costs.lookup_s if ng is not None else 0.0
        extra = CatchUp.extra_rows(self.head.pending) if self.head is not None else 0
        catch_up = self.catch.price(extra)
        choice = self.policy.choose(gains, room, n_ctx, self.scale.value, catch_up, self.beyond.share, look)
        if ng is not None:
            self.pending.append(ng)
        tree, model_tree, expected = DraftTree.empty(), None, 0.0
        if choice.budget is not None:
            backlog = self.head.unread_steps if self.head is not None else 0
            tree = model_tree = yield from self.model.drafting(ctx, choice.budget)
            b = choice.budget
            expected = self.policy.gain[b] * min(len(tree), b.tree_size) / b.tree_size
        if choice.chain and room > len(tree):
            part = ng.part(min(choice.chain, room - len(tree), len(ng.tokens)))
            tree = tree.union(part) if len(tree) else part
        self.last = (model_tree, expected, ng)
        self.choices[min(len(tree), room)] += 1
        self.rows, self.rows_ctx = 1 + min(len(tree), room), n_ctx  # the verify forward's, for the clock
        # a head's drafting priced with its catch-up: priced without it, the reads after a plain stretch
        # taught the clock drafting costs ~2x, so auto drafted ever less and each catch-up grew longer
        self.draft_priced = None
        if self.head is not None and choice.budget is not None:
            base = self.policy.draft_s[choice.budget] + self.policy.follow_s + look
            self.draft_priced = base + catch_up if extra <= PRICED_ROWS else None
            self.catch.drafted(extra if backlog > 1 else 0, base)
        return tree

    def _ngram(self, ctx: DecodeContext) -> NgramDraft | None:
        if self.ngram is None:
            return None
        toks, parents, confs, tree = self.ngram.scored(ctx)
        return NgramDraft(toks, parents, confs, len(ctx.tokens), tree) if toks else None

    def reading_pays(self, ctx: DecodeContext) -> bool:
        """Whether the draft model's first chain pays for reading the context first: the seconds its best
        chain saves over the tokens the answer may still take (at most ctx.max_nodes + 1) against the rows
        it reads at Costs.catch_row_s, every sequence sharing the step waiting for them. Why: on a 4k-token
        prompt the Qwen 0.5B read for ~13 s to save ~2 s of a 256-token answer, and stalled the stream."""
        rows = len(ctx.tokens) - len(self.model.cached)
        n = len(ctx.tokens)
        plain = self.policy.costs.target(1, n)
        best = min((secs / tokens for tokens, secs in (self.policy.expected(Choice(b, 0), [], ctx.max_nodes, n)
                                                       for b, _ in self.menu)), default=plain)
        return rows * self.costs.catch_row_s * ctx.sharing < (ctx.max_nodes + 1) * (plain - best)

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        if self.rows and self.clock is not None:
            if self.clock.note(ctx.forward_s, self.rows, self.rows_ctx):
                self.clock.settle(self.costs.target)
            if self.draft_priced is not None:
                self.clock.observe_draft(ctx.draft_s, self.draft_priced)
        self.rows = 0
        self.catch.observe(ctx.draft_s)
        for d in (self.model, self.ngram):
            if d is not None:
                d.accept(ctx, verdict)
        model_tree, expected, ng = self.last or (None, 0.0, None)
        self.last = None
        observed = model_tree is not None and len(model_tree) > 0
        self.scale.step(observed)
        if observed:
            m = matched(model_tree, verdict.tokens)
            if self.head is not None:
                self.scale.observe(m, expected)
            else:
                self.rate.observe(m, len(model_tree))
                self.policy.regain(self.rate.gains(self.menu))
            if ng is not None:
                ng.model = m
        self.cal.step()
        keep = []
        for i, p in enumerate(self.pending):
            outcome, over = tried(p.children(), p.tokens, ctx.tokens[p.start:])
            if over or len(self.pending) - i > MAX_PENDING:  # the oldest past the cap: what it showed so far
                for node, hit in outcome:
                    self.cal.observe(p.confs[node], hit)
                if p.model is not None:
                    self.beyond.observe(sum(hit for _, hit in outcome), p.model)
            else:
                keep.append(p)
        self.pending = keep

    def end(self, answer: list[int]) -> None:
        if self.ngram is not None:
            self.ngram.end(answer)
