"""Adaptive speculation: every step, the draft that maximises expected tokens per second under costs
measured on this machine, including no draft at all (a plain vanilla step).

Two models, kept apart because only one of them travels:
- acceptance (machine-independent; `specdec tune` measures it and ships it with the head): the greedy
  tau of each EAGLE-2 tree budget by exact replay, and the T = 1 tau of trees whose children are drawn
  from the draft (sampled requests draft those: tau +0.2 over top-k children at T = 1);
- costs (machine-dependent, drafters/costs.py): t(N) of the target, each budget's draft time, the
  head's catch-up after a step, the prompt lookup.

Online, per request, a decaying ratio of observed to expected accepted tokens scales the table (text
gets easier or harder within an answer: lists, repeats, code), and a decaying mean of the lookup
chain's matched length prices the chain. Without observations both drift back to their priors, so a
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

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.clock import CatchUp, StepClock
from specdec.drafters.costs import QUIET, Costs, store_learned
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.machine import ContentionMeter
from specdec.tree import DraftTree, TreeBudget
from specdec.verify import Verdict, greedy_walk

DECAY = 0.85  # per step: an observation's weight halves in ~4 steps
PRIOR_WEIGHT = 2.0  # the prior counts as this many expected accepted tokens
SAMPLED_SCALE = 0.55  # prior for T > 0 when the table has none: shipped head, alpha_1 0.35 at T=1 vs 0.64 greedy
# prior matched tokens of a lookup chain by the n-gram length it matched (greedy; sampled: half)
LOOKUP_PRIOR = {1: 0.5, 2: 1.0, 3: 1.5}
MAX_PENDING = 8  # unverified chains followed at once (each ends within its length)
# a draft must promise this much more than a plain step. Why: near break-even the estimates' errors and
# the retries after plain steps cost more than drafting gains; measured on SmolLM2 (the README demo
# prompt drafted 2-node trees that accepted 0.33 tokens against a break-even of 0.35: 0.94x vanilla)
HURDLE = 0.05


def menu_from_tuning(rows: list[dict]) -> list[tuple[TreeBudget, float]]:
    """(budget, greedy expected accepted tokens = tau - 1) per tree size, from tune's acceptance table
    (tuning.load_acceptance): for each size the best tau at depth <= 4 and the best at depth 2 (cheaper
    to draft), never below a smaller size's best."""
    best: dict[tuple[int, bool], tuple[float, TreeBudget]] = {}
    for r in rows:
        b = TreeBudget(r["depth"], r["topk"], r["tree_size"])
        if b.depth > 4 or b.topk > 4:
            continue
        for shallow in {False, b.depth == 2}:
            key = (b.tree_size, shallow)
            if key not in best or r["tau"] > best[key][0]:
                best[key] = (r["tau"], b)
    if not best:
        return [(TreeBudget(2, 3, 4), 0.9), (TreeBudget(3, 4, 8), 1.1)]
    # a larger tree accepts at least what the best smaller one does: a sampled table's lower estimate is noise
    menu = {b: max([tau - 1] + [t - 1 for t, s in best.values() if s.tree_size < b.tree_size])
            for tau, b in best.values()}
    menu = list(menu.items())  # a budget both the best and the best shallow one of its size is listed once
    return sorted(menu, key=lambda x: (x[0].tree_size, x[0].depth))


@dataclass(frozen=True)
class Choice:
    budget: TreeBudget | None  # None: no model tree
    chain: int  # nodes of the lookup draft joined to the verify (0: none)

    @property
    def vanilla(self) -> bool:
        return self.budget is None and not self.chain


VANILLA = Choice(None, 0)


class Controller:
    """The per-request estimates and the per-step choice (pure arithmetic: unit-tested on its own).

    Tree: a decaying ratio of observed to expected accepted tokens scales the table's gains. Chain, per
    n-gram length it matched (a 3-gram match predicts far better than a 1-gram one): the decaying mean
    of its matched tokens (`alone`), and of what it adds beyond the head's tree (`extra` =
    max(0, chain matched - tree matched)), which prices the tree + chain union (offered only if `union`).
    Or, where the caller passes `gains` (gains[m - 1]: expected accepted tokens of the lookup draft's
    first m nodes, from its own calibrated confidences), every prefix of the draft is priced by them,
    and a union by the larger of its parts. `draft_s`: what each menu budget's propose() costs (default:
    the top-k trees' costs)."""

    def __init__(self, menu: list[tuple[TreeBudget, float]], costs: Costs, scale: float,
                 lookup_prior: dict[int, float] | None = None, decay: float = DECAY,
                 prior_weight: float = PRIOR_WEIGHT, draft_s: dict[TreeBudget, float] | None = None,
                 union: bool = True, hurdle: float = HURDLE) -> None:
        self.menu, self.costs, self.decay, self.union, self.hurdle = menu, costs, decay, union, hurdle
        self.draft_s = costs.draft_s if draft_s is None else draft_s
        self.gain = dict(menu)
        self.scale_prior, self.weight = scale, prior_weight
        self.num, self.den = prior_weight * scale, prior_weight  # tree: decayed observed / expected tokens
        self.misses = 0  # head trees in a row that had nothing accepted
        self.chain_prior = dict(lookup_prior or {})
        # n-gram -> [alone sum, extra sum, observations], decayed; the prior counts as one observation
        self.chain = {n: [p, p / 2, 1.0] for n, p in self.chain_prior.items()}

    @property
    def scale(self) -> float:
        return self.num / self.den

    def chain_mean(self, ngram: int) -> tuple[float, float]:
        """(matched tokens of the chain alone, tokens it adds to a tree) expected for this n-gram."""
        a, e, n = self.chain.get(ngram, (0.0, 0.0, 1.0))
        return a / n, e / n

    def expected(self, choice: Choice, chain_len: int, room: int, ngram: int = 0, ctx: int | None = None,
                 gains: list[float] | None = None, catch_up: float = 0.0) -> tuple[float, float]:
        """(expected tokens, expected seconds) of one step with this choice, after ctx cached tokens;
        catch_up: the seconds a head tree pays first to read the rows of steps it skipped."""
        c = self.costs
        tree = 0.0
        nodes = 0
        secs = c.lookup_s if chain_len else 0.0
        if choice.budget is not None:
            b = choice.budget
            nodes = min(b.tree_size, room)
            tree = self.scale * self.gain[b] * nodes / b.tree_size
            secs += self.draft_s[b] + c.follow_s + catch_up
        extra = 0.0
        if choice.chain:
            n = min(choice.chain, room - nodes)
            if gains is None:
                alone, added = self.chain_mean(ngram)
            else:  # a union is worth at least its better part (a lower bound: no learnt overlap here)
                alone = gains[n - 1] if n > 0 else 0.0
                added = max(0.0, alone - tree)
            extra = min(float(n), added if choice.budget is not None else alone)
            nodes += n
        return 1.0 + tree + extra, secs + c.target(1 + nodes, ctx)

    def choose(self, chain_len: int, room: int, ngram: int = 0, ctx: int | None = None,
               gains: list[float] | None = None, catch_up: float = 0.0) -> Choice:
        """chain_len: nodes of this step's lookup draft (0: none); with `gains`, each of its prefixes is
        an option, else the whole draft. The options are vanilla, each menu tree, and per chain length the
        chain alone and each tree + chain, priced as `expected` prices them (the same arithmetic, inlined:
        this runs every step, and on text that drafts nothing it is most of what `auto` adds to a step)."""
        if room <= 0:
            return VANILLA
        c, scale = self.costs, self.scale
        look = c.lookup_s if chain_len else 0.0
        t_rows: dict[int, float] = {}

        def target(rows: int) -> float:
            t = t_rows.get(rows)
            if t is None:
                t = t_rows[rows] = c.target(rows, ctx)
            return t

        # per menu tree: (budget, nodes, expected tree tokens, seconds before the forward)
        trees = []
        for b, g in self.menu:
            nodes = min(b.tree_size, room)
            trees.append((b, nodes, scale * g * nodes / b.tree_size, look + (self.draft_s[b] + c.follow_s + catch_up)))
        rates: list[tuple[float, TreeBudget | None, int]] = [(1.0 / (look + target(1)) * (1 + self.hurdle), None, 0)]
        rates += [((1.0 + tree) / (secs + target(1 + nodes)), b, 0) for b, nodes, tree, secs in trees]
        lengths = range(1, min(chain_len, room) + 1) if gains is not None else [chain_len] if chain_len else []
        alone, added = self.chain_mean(ngram) if gains is None else (0.0, 0.0)
        for m in lengths:
            n = min(m, room)
            if gains is not None:
                alone = gains[n - 1] if n > 0 else 0.0
            rates.append(((1.0 + 0.0 + min(float(n), alone)) / (look + target(1 + n)), None, m))
            if not self.union:
                continue
            for b, nodes, tree, secs in trees:
                n = min(m, room - nodes)
                if gains is not None:
                    alone = gains[n - 1] if n > 0 else 0.0
                    added = max(0.0, alone - tree)
                rates.append(((1.0 + tree + min(float(n), added)) / (secs + target(1 + nodes + n)), b, m))
        best = max(r for r, _, _ in rates)
        # ties (within 0.5%) go to the cheapest option: vanilla first, then smaller trees
        r, b, m = next(x for x in rates if x[0] >= best * 0.995)
        return VANILLA if b is None and not m else Choice(b, m)

    def step(self, tree_observed: bool = False) -> None:
        """Every step decays the evidence. A step that verified no head tree also pulls the tree estimate
        toward its prior (so a stretch of plain steps ends with a try); one that did adds its observation
        instead. Why not both: a pull on every step weighs the prior like ~30% of the evidence, so a
        stretch of text accepting half the table's tokens read as 0.66 of it and kept drafting at a loss.
        Each try in a row that had nothing accepted halves the pull (down to an eighth): on text the head
        cannot follow the tries were pure loss (Spec-Bench QA at T = 1: 4-7 tries in 81 steps, none
        accepted, 0.95x vanilla)."""
        d, w = self.decay, self.weight * 0.5 ** min(self.misses, 3)
        self.num, self.den = d * self.num, d * self.den
        if not tree_observed:
            self.num += (1 - d) * w * self.scale_prior
            self.den += (1 - d) * w
        for n, s in self.chain.items():
            p = self.chain_prior[n]
            s[0], s[1], s[2] = d * s[0] + (1 - d) * p, d * s[1] + (1 - d) * p / 2, d * s[2] + (1 - d)

    def observe_tree(self, accepted: int, expected: float) -> None:
        self.num += accepted
        self.den += expected
        self.misses = 0 if accepted else self.misses + 1

    def observe_chain(self, ngram: int, alone: float, extra: float | None) -> None:
        """alone: what the chain matched; extra: beyond the tree's accepted tokens (None: no tree drafted)."""
        s = self.chain.setdefault(ngram, [0.0, 0.0, 0.0])
        self.chain_prior.setdefault(ngram, 0.0)
        if extra is None:  # no tree this step: a tree's typical accepted tokens stand in
            extra = max(0.0, alone - self.scale * self.gain[self.menu[0][0]])
        s[0] += alone
        s[1] += extra
        s[2] += 1.0


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
        if self.clock is not None and self.clock.drifted:
            self.costs = self.costs.rescaled(self.clock.factors(), self.clock.draft_factor())
            self.clock = self.clock.restarted()
            self.relearned += 1
            busy = self._meter.result().get("other_cpu_frac")
            if self.cache is not None and busy is not None and busy <= QUIET:  # never prices learned under load
                with contextlib.suppress(OSError, ValueError, KeyError):
                    store_learned(self.cache, self.costs)
            self._meter = ContentionMeter()

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
        # state of its own, these costs; no clock: in a batch its verify_s times the whole packed forward
        return replace(self, eagle=self.eagle.fork(), clock=None, choices=Counter())

    @property
    def lead(self) -> Drafter:
        return self.eagle

    def begin(self, ctx: DecodeContext) -> None:
        greedy = ctx.params.greedy
        prior = {n: p if greedy else p / 2 for n, p in LOOKUP_PRIOR.items()}
        costs = self.costs
        if greedy or self.sampled is None:
            self.ctrl = Controller(self.menu, costs, 1.0 if greedy else self.sampled_scale, prior)
        else:
            self.ctrl = Controller(self.sampled, costs, 1.0, prior, draft_s=costs.sampled_s, union=False)
        self.choices = Counter()
        self.last = None
        self.rows = 0
        self.pending: list[tuple] = []  # unverified chains still matching: (tokens, n-gram, start, tree matched)
        self.eagle.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        chain = self.pld.propose(ctx) if self.pld is not None and ctx.max_nodes > 0 else DraftTree.empty()
        ngram = self.pld.last_ngram if len(chain) else 0
        backlog = len(self.eagle.pending)  # steps whose rows the head has not read yet
        extra = self.catch.extra_rows(self.eagle.pending)
        choice = self.ctrl.choose(len(chain), ctx.max_nodes, ngram, len(ctx.tokens), catch_up=self.catch.price(extra))
        self.choices[(choice.budget.tree_size if choice.budget else 0) + (len(chain) if choice.chain else 0)] += 1
        tree = DraftTree.empty()
        expected = 0.0
        if choice.budget is not None:
            tree = self.eagle.propose(ctx, choice.budget)
            b = choice.budget
            expected = self.ctrl.gain[b] * min(len(tree), b.tree_size) / b.tree_size
        eagle_tree = tree if choice.budget is not None else None
        if choice.chain and ctx.max_nodes > len(tree):
            tree = tree.union(chain.select(torch.arange(min(len(chain), ctx.max_nodes - len(tree)))))
        self.last = (choice, eagle_tree, expected, chain if len(chain) else None, ngram)
        self.rows = 1 + min(len(tree), ctx.max_nodes)  # the forward's rows and context, for the clock
        self.rows_ctx = len(ctx.tokens)
        # what this step's drafting was priced at (None: no head tree, only a lookup at most; or a head that
        # first read several steps' rows: that catch-up is no typical step's, and priced as one it taught the
        # clock drafting costs ~2x, so auto drafted ever less and each catch-up grew longer)
        base = None if choice.budget is None else \
            self.ctrl.draft_s[choice.budget] + self.costs.follow_s + (self.costs.lookup_s if len(chain) else 0.0)
        self.draft_priced = None if backlog > 1 else base
        self.catch.drafted(extra if base is not None and backlog > 1 else 0, base or 0.0)
        return tree

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        if self.rows and self.clock is not None:
            self.clock.observe(ctx.verify_s, self.costs.target(self.rows, self.rows_ctx), self.rows)
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
            m = matched(chain, new)
            if not choice.chain and m == len(new) < len(chain):
                # unverified and still matching: follow it over the next steps' tokens (what it would have
                # matched, learnt for free: a chain the controller never verifies is still priced right)
                self.pending.append((chain.tokens.tolist(), ngram, len(ctx.tokens) - len(new), t))
            else:
                ctrl.observe_chain(ngram, float(m), None if t is None else max(0.0, m - t))
        self._follow_pending(ctx)
        self.last = None

    def _follow_pending(self, ctx: DecodeContext) -> None:
        keep = []
        for i, (toks, ngram, start, t) in enumerate(self.pending):
            seq = ctx.tokens[start:start + len(toks)]
            m = next((j for j, (a, b) in enumerate(zip(toks, seq)) if a != b), len(seq))
            # settled: it stopped matching, matched whole, or is among the oldest past MAX_PENDING (m so far)
            if m < len(seq) or m == len(toks) or len(self.pending) - i > MAX_PENDING:
                self.ctrl.observe_chain(ngram, float(m), None if t is None else max(0.0, m - t))
            else:
                keep.append((toks, ngram, start, t))
        self.pending = keep
