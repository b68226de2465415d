"""Adaptive speculation: every step, the draft that maximises expected tokens per second under costs
measured on this machine, including no draft at all (a plain vanilla step).

Two models, kept apart because only one of them travels:
- acceptance (machine-independent; `specdec tune` measures it and ships it with the head): the greedy
  tau of each EAGLE-2 tree budget by exact replay, and the T = 1 tau of trees whose children are drawn
  from the draft (sampled requests draft those: tau +0.2 over top-k children at T = 1);
- costs (machine-dependent, drafters/costs.py): t(N) of the target, each budget's draft time, the
  head's catch-up after a step, the prompt lookup.

Online, per request (drafters/controller.py), a decaying ratio of observed to expected accepted tokens
scales the table (text gets easier or harder within an answer: lists, repeats, code), and the decaying
share of lookup chains that matched at least i tokens prices each prefix of the chain. Without
observations both drift back to their priors, so a
stretch of vanilla steps ends with a try. Both read only verdicts of earlier steps, and the costs are
fixed within a request: a step's draft never depends on that step's verdict (lossless, greedy and
sampled). Between requests the costs are rescaled to the observed forwards if they drifted from them
(costs.StepClock: another load; nothing is timed for it). No text depends on these choices: greedy
text is the target's argmax, and a seeded sampled request's is the target's coupled draw
(sampling.Coupling), whatever was drafted.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.drafters.base import DecodeContext, Drafter, Drafting, alone
from specdec.drafters.clock import CatchUp, StepClock
from specdec.drafters.controller import LOOKUP_PRIOR, LOOKUP_PRIOR_SAMPLED, VANILLA, Controller
from specdec.drafters.costs import QUIET, Costs, store_learned
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.runtime.cpus import ContentionMeter
from specdec.tree import DraftTree, TreeBudget
from specdec.verify import Verdict, greedy_walk

SAMPLED_SCALE = 0.55  # prior for T > 0 when the table has none: shipped head, alpha_1 0.35 at T=1 vs 0.64 greedy
MAX_PENDING = 8  # unverified chains followed at once (each ends within its length)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share: what a chain matched of the tokens emitted after it."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def matched(tree: DraftTree, tokens: list[int]) -> int:
    """How far the emitted tokens follow a path of `tree`: the verifier's own walk. A rejected child can
    never be emitted (a point mass leaves the residual no mass there; a sampled child x is rejected only
    where p(x) < q(x), where the residual max(0, p - q) is 0), so this is the accepted length in the tree."""
    return len(greedy_walk(tree, lambda _, k: tokens[k] if k < len(tokens) else None)[0])


class FollowsTheMachine(Drafter):
    """A drafter priced by measured costs: fixed within a request, rescaled between requests to what its
    verify forwards took once they drift from their prices (another load): learned from the steps
    already run, so no request waits for a measurement.
    Subclasses set costs, clock (costs.StepClock, or None: costs fixed), relearned = 0 and origin (how the
    costs were obtained at build: "cached" or "measured at load in 3.1 s")."""

    origin: str = "given"
    cache: Path | None = None  # the cost file the costs came from: learned prices go back there
    _meter: ContentionMeter | None = None  # other processes' load since the prices were last (re)set

    def prepare(self) -> None:
        if self._meter is None:
            self._meter = ContentionMeter()
        if self.clock is not None:
            self.clock.settle(self.costs.target)
        if self.clock is not None and self.clock.drifted:
            self.costs = self.costs.rescaled(self.clock.factors(), self.clock.draft_factor())
            self.clock = self.clock.restarted()
            self.relearned += 1
            busy = self._meter.result().get("other_cpu_frac")
            if self.cache is not None and busy is not None and busy <= QUIET:  # never prices learned under load
                with contextlib.suppress(OSError, ValueError, KeyError):
                    store_learned(self.cache, self.costs)
            self._meter = ContentionMeter()

    def share(self, ctx: DecodeContext) -> None:
        """Price this step's rows for the sequences sharing its forward (ctx.sharing; Costs.shared)."""
        if ctx.sharing != self.ctrl.sharing:
            self.ctrl.reprice(self.costs.shared(ctx.sharing), ctx.sharing)

    @property
    def costs_source(self) -> str:
        return f"{self.origin}, then learned online ({self.relearned}x)" if self.relearned else self.origin


@dataclass
class AdaptiveDrafter(FollowsTheMachine):
    """`auto`'s drafter: an EAGLE head + a prompt-lookup chain, sized (or skipped) every step by the
    Controller. The chain is looked up first (it depends only on emitted tokens), then the choice."""

    eagle: EagleDrafter
    menu: list[tuple[TreeBudget, float]]
    costs: Costs
    lookup: int = 0  # chain tokens (0: no lookup)
    sampled_scale: float = SAMPLED_SCALE  # T > 0 without a sampled menu: the greedy table, scaled
    # T > 0: (budget, expected accepted tokens) of trees with children drawn from the draft (eagle's
    # children="sample"), priced by costs.sampled_s; never merged with the chain (point masses only)
    sampled: list[tuple[TreeBudget, float]] | None = None
    name: str = "eagle2+pld adaptive"
    choices: Counter = field(default_factory=Counter)  # this request's choices (bench, tests)
    clock: StepClock | None = None  # None: the costs stay as given
    origin: str = "given"
    cache: Path | None = None

    def __post_init__(self) -> None:
        self.pld = PromptLookupDrafter(chain_len=self.lookup) if self.lookup else None
        self.aux_layers = self.eagle.aux_layers  # an EAGLE-3 head reads the target's states at these layers
        if (self.sampled is not None) != (self.eagle.children == "sample"):
            raise ValueError("a sampled menu needs an EAGLE drafter with children='sample', and only then")
        self.draft_depth = max(b.depth for b, _ in [*self.menu, *(self.sampled or [])])
        if not self.lookup:
            self.name = "eagle2 adaptive"
        self.ctrl: Controller | None = None
        self.last: tuple | None = None  # (choice, head tree, its expected tokens, chain, n-gram)
        self.pending: list[tuple] = []
        self.rows = self.rows_ctx = 0  # rows and context of the forward verifying the last proposal (0: none)
        self.draft_priced: float | None = None
        self.relearned = 0
        self.catch = CatchUp(self.costs.catch_row_s)  # measured at load, then learned over requests

    def fork(self) -> AdaptiveDrafter:
        # state of its own, these costs; no clock: in a batch its forward_s times the whole packed forward
        return replace(self, eagle=self.eagle.fork(), clock=None, choices=Counter())

    @property
    def lead(self) -> Drafter:
        return self.eagle

    def begin(self, ctx: DecodeContext) -> None:
        greedy = ctx.params.greedy
        prior = LOOKUP_PRIOR if greedy else LOOKUP_PRIOR_SAMPLED
        costs = self.costs
        if greedy or self.sampled is None:
            self.ctrl = Controller(self.menu, costs, 1.0 if greedy else self.sampled_scale, prior)
        else:
            self.ctrl = Controller(self.sampled, costs, 1.0, prior, draft_s=costs.sampled_s, union=False)
        self.choices = Counter()
        self.last = None
        self.rows = 0
        # chains still matching past the tokens seen: (tokens, n-gram, start, what the step's tree matched)
        self.pending: list[tuple] = []
        self.eagle.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return alone(self.drafting(ctx))

    def drafting(self, ctx: DecodeContext) -> Drafting:
        self.share(ctx)
        chain = self.pld.lookup(ctx) if self.pld is not None and ctx.max_nodes > 0 else []
        self.rows_ctx = len(ctx.tokens)
        ngram = self.pld.last_ngram if chain else 0
        # most steps on text that drafts nothing; the chain at its bound and no catch-up (both only make
        # drafting look better): what choose() would decide
        if self.ctrl.surely_plain(ctx.max_nodes, self.rows_ctx, 0.0,
                                  self.ctrl.chain_bound(ngram, min(len(chain), ctx.max_nodes)) if chain else 0.0):
            self.choices[0] += 1
            self.last, self.rows, self.draft_priced = (VANILLA, None, 0.0, chain or None, ngram), 1, None
            self.catch.drafted(0, 0.0)
            return DraftTree.empty()
        gains = self.ctrl.chain_gains(ngram, len(chain)) if chain else None
        beyond = self.ctrl.chain_beyond(ngram) if chain else None
        backlog = self.eagle.unread_steps
        extra = self.catch.extra_rows(self.eagle.pending)
        choice = self.ctrl.choose(len(chain), ctx.max_nodes, self.rows_ctx, gains, self.catch.price(extra), beyond)
        self.choices[(choice.budget.tree_size if choice.budget else 0) + (len(chain) if choice.chain else 0)] += 1
        tree = DraftTree.empty()
        expected = 0.0
        if choice.budget is not None:
            tree = yield from self.eagle.drafting(ctx, choice.budget)
            b = choice.budget
            expected = self.ctrl.gain[b] * min(len(tree), b.tree_size) / b.tree_size
        eagle_tree = tree if choice.budget is not None else None
        if choice.chain and ctx.max_nodes > len(tree):
            part = DraftTree.chain(torch.tensor(chain[:min(choice.chain, ctx.max_nodes - len(tree))], dtype=torch.long))
            tree = tree.union(part) if len(tree) else part
        self.last = (choice, eagle_tree, expected, chain or None, ngram)
        self.rows = 1 + min(len(tree), ctx.max_nodes)  # the forward's rows (and rows_ctx its context), for the clock
        # what this step's drafting was priced at, its catch-up included (None: no head tree, only a lookup at
        # most; or a catch-up of more rows than are counted. Why with the catch-up: priced without it, the
        # reads after a plain stretch taught the clock drafting costs ~2x, so auto drafted ever less and each
        # catch-up grew longer; left out, the clock saw only steps right after a draft, and in-situ drafting
        # at ~2x its probe went unlearned: the README demo prompt kept trying 4-node trees at a loss)
        base = None if choice.budget is None else \
            self.ctrl.draft_s[choice.budget] + self.costs.follow_s + (self.costs.lookup_s if len(chain) else 0.0)
        self.draft_priced = None if base is None or extra > CatchUp.PRICED_ROWS else base + self.catch.price(extra)
        self.catch.drafted(extra if base is not None and backlog > 1 else 0, base or 0.0)
        return tree

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        if self.rows and self.clock is not None:
            if self.clock.note(ctx.forward_s, self.rows, self.rows_ctx):
                self.clock.settle(self.costs.target)
            if self.draft_priced is not None:
                self.clock.observe_draft(ctx.draft_s, self.draft_priced)
            self.rows = 0
        self.catch.observe(ctx.draft_s)
        self.eagle.accept(ctx, verdict)
        if self.last is None:
            return
        choice, eagle_tree, expected, chain, ngram = self.last
        ctrl, new = self.ctrl, verdict.tokens
        observed = eagle_tree is not None and len(eagle_tree) > 0
        ctrl.step(observed)
        t = None
        if observed:
            t = matched(eagle_tree, new)
            ctrl.observe_tree(t, expected)
        if chain is not None:
            m = common_prefix(chain, new)
            if m == len(new) < len(chain):
                # still matching past what this step emitted (unverified, or verified in part): follow it over
                # the next steps' tokens, so a chain is priced by what it would have matched
                self.pending.append((chain, ngram, len(ctx.tokens) - len(new), t))
            else:
                ctrl.observe_chain(ngram, m, len(chain), t)
        self._follow_pending(ctx)
        self.last = None

    def _follow_pending(self, ctx: DecodeContext) -> None:
        keep = []
        for i, (toks, ngram, start, t) in enumerate(self.pending):
            seq = ctx.tokens[start:start + len(toks)]
            m = common_prefix(toks, seq)
            if m < len(seq) or m == len(toks):  # settled: it stopped matching, or matched whole
                self.ctrl.observe_chain(ngram, m, len(toks), t)
            elif len(self.pending) - i > MAX_PENDING:  # among the oldest past the cap: what it showed so far
                self.ctrl.observe_chain(ngram, m, m, t)
            else:
                keep.append((toks, ngram, start, t))
        self.pending = keep
