"""`auto` without a head: every step, the n-gram draft prefix (drafters/ngram.py), the draft-model chain
(when `draft=` gives one) or their union that maximises expected tokens per second, or no draft at all.

The choice is the head case's (controller.Controller over costs.Costs measured on this machine), with
no hurdle over a plain step and the draft-model chains priced by their learned per-token acceptance alone
(ChainAcceptance; the head case's scale of observed to expected tokens stays at 1: on top of a learned rate it
counted every miss twice, and `auto` fell back to plain steps where chains paid), and the n-gram draft
priced prefix by prefix: the chance that each node is accepted is its own confidence
(ngram.py), calibrated online, so the draft's length follows what the target's t(N) makes worth
verifying (an int8 target's t(8) may be 2-3 t(1)). Calibration: per bucket of raw confidence, a
decaying rate of how often such a node's token was the one emitted next, with the raw confidence as
its prior. Every step's n-gram draft is scored on the tokens emitted after it, verified or not, so a
stretch of plain steps still learns when the text starts repeating.

Losslessness: the draft of a step depends on emitted tokens, on verdicts of earlier steps and on costs
fixed within the request, never on that step's own verdict; n-gram drafts are point masses, and a
sampled draft-model chain is never merged with them.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.drafters.adaptive import MAX_PENDING, FollowsTheMachine, matched
from specdec.drafters.base import DecodeContext, Drafter, Drafting, NoDrafter, alone
from specdec.drafters.clock import StepClock
from specdec.drafters.controller import Choice, Controller
from specdec.drafters.costs import Costs, load_plain_costs
from specdec.drafters.draft_model import DRAFT_QUANT, DRAFT_VOCAB, DraftModelDrafter, DraftQuant, draft_runner
from specdec.drafters.ngram import NgramDrafter, NgramOptions
from specdec.drafters.registry import Target
from specdec.tree import DraftTree, TreeBudget
from specdec.verify import Verdict

NODES = 16  # n-gram draft nodes offered per step (the controller verifies the prefix that pays)
TOPK = 2  # continuations per n-gram node: a branch where the counts disagree
MIN_VALUE = 0.01  # nodes less likely than this to be accepted are not worth drafting
DRAFT_CHAINS = (1, 2, 3, 4, 6)  # draft-model chain lengths offered
DRAFT_ALPHA = 0.7  # prior chance a draft-model token is accepted given its parent was
# ... counted as this many drafted tokens; each chain verified then weighs the evidence by ALPHA_DECAY. Why
# learn it: a menu priced by the prior's shape (0.7 per token) chose chains of 1-2 where a same-family
# draft accepted 0.9 a token (Qwen2.5-Coder 0.5B for 1.5B on code), and longer chains paid more
ALPHA_PRIOR = 4.0
ALPHA_DECAY = 0.9
# the prior at T > 0: a drafted x is accepted with probability min(1, p(x) / q(x)), not whenever it is the argmax
DRAFT_ALPHA_SAMPLED = 0.5
EDGES = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9)  # raw-confidence buckets of the calibration
CAL_DECAY = 0.95  # per step: slower than the controller's, the buckets see fewer observations each
CAL_PRIOR = 2.0  # the raw confidence counts as this many observations
SAMPLED_CONF = 0.7  # prior factor at T > 0: a point mass x is accepted with the target's p(x), not 1


class ChainAcceptance:
    """P(a draft-model token is accepted | its parent was), learned from the chains verified: a chain of k
    tokens whose first m were accepted shows m acceptances in min(m + 1, k) tries."""

    def __init__(self, prior: float = DRAFT_ALPHA) -> None:
        self.prior = prior
        self.hits, self.tries = ALPHA_PRIOR * prior, ALPHA_PRIOR

    @property
    def alpha(self) -> float:
        return self.hits / self.tries

    def observe(self, accepted: int, drafted: int) -> None:
        self.hits = ALPHA_DECAY * self.hits + (1 - ALPHA_DECAY) * ALPHA_PRIOR * self.prior + accepted
        self.tries = ALPHA_DECAY * self.tries + (1 - ALPHA_DECAY) * ALPHA_PRIOR + min(accepted + 1, drafted)

    def gains(self, menu: list[tuple[TreeBudget, float]]) -> dict[TreeBudget, float]:
        """Each chain's expected accepted tokens: alpha + alpha^2 + ... over its depth."""
        a = self.alpha
        return {b: sum(a ** i for i in range(1, b.depth + 1)) for b, _ in menu}


class Calibration:
    """P(a draft node's token is the one emitted next | its parent's was), by the node's raw confidence."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.hits = [0.0] * (len(EDGES) + 1)
        self.tries = [0.0] * (len(EDGES) + 1)

    def rate(self, conf: float) -> float:
        b = bisect.bisect_right(EDGES, conf)
        return (self.hits[b] + CAL_PRIOR * self.scale * conf) / (self.tries[b] + CAL_PRIOR)

    def values(self, confs: list[float], parents: list[int]) -> list[float]:
        """Each node's chance to be accepted: the calibrated rates along its path."""
        out: list[float] = []
        for c, p in zip(confs, parents):
            out.append((out[p] if p >= 0 else 1.0) * self.rate(c))
        return out

    def observe(self, conf: float, hit: bool) -> None:
        b = bisect.bisect_right(EDGES, conf)
        self.hits[b] += hit
        self.tries[b] += 1.0

    def step(self) -> None:
        self.hits = [CAL_DECAY * h for h in self.hits]
        self.tries = [CAL_DECAY * t for t in self.tries]


def confidences(tree: DraftTree) -> list[float]:
    """Each node's confidence given its parent, from the tree's log path values."""
    if tree.scores is None:
        return [1.0] * len(tree)
    s, par = tree.scores.tolist(), tree.parents.tolist()
    return [math.exp(v - (s[p] if p >= 0 else 0.0)) for v, p in zip(s, par)]


def tried(children: list[list[int]], tokens: list[int], emitted: list[int]) -> tuple[list[tuple[int, bool]], bool]:
    """The nodes the emitted tokens put to the test (every child of the root and of each matched node)
    and whether each was the token emitted; and whether the walk is over (a miss or a leaf) rather than
    waiting for more tokens."""
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
class _Pending:
    tokens: list[int]
    children: list[list[int]]
    confs: list[float]
    start: int  # len(ctx.tokens) when drafted: it guesses ctx.tokens[start:]


@dataclass
class HeadlessDrafter(FollowsTheMachine):
    ngram: NgramDrafter | None
    costs: Costs
    draft: DraftModelDrafter | None = None
    menu: list[tuple[TreeBudget, float]] = field(default_factory=list)  # draft-model chains, prior gains
    clock: StepClock | None = None  # None: the costs stay as given
    origin: str = "given"
    cache: Path | None = None
    choices: Counter = field(default_factory=Counter)  # this request's verified draft sizes (bench, tests)

    def __post_init__(self) -> None:
        if self.ngram is None and self.draft is None:
            raise ValueError("auto without a head needs an n-gram drafter or a draft model")
        if (self.draft is None) != (not self.menu):
            raise ValueError("a draft-model menu needs a draft model, and only then")
        parts = (["ngram"] if self.ngram is not None else []) + (["sps"] if self.draft is not None else [])
        self.name = "+".join(parts) + " adaptive (auto, no head)"
        self.draft_depth = max([self.ngram.tree_size if self.ngram else 0] + [b.depth for b, _ in self.menu])
        self.relearned = 0
        self.rows = self.rows_ctx = 0
        self.pending: list[_Pending] = []
        self.last: DraftTree | None = None  # the draft-model chain this step verifies

    def fork(self) -> HeadlessDrafter | None:
        """Another sequence of a batch: forks of the n-gram and draft-model drafters, its own Controller,
        calibration and pending drafts, priced by this drafter's costs as they stand; never learning
        prices (clock None: in a batch a sequence's forward_s times the whole packed forward)."""
        draft = None if self.draft is None else self.draft.fork()
        if self.draft is not None and draft is None:
            return None
        ngram = None if self.ngram is None else self.ngram.fork()
        return dataclasses.replace(self, ngram=ngram, draft=draft, clock=None, choices=Counter())

    def begin(self, ctx: DecodeContext) -> None:
        greedy = ctx.params.greedy
        self.ctrl = self._controller(self.menu, greedy)
        self.cal = Calibration(1.0 if greedy else SAMPLED_CONF)
        self.chain_rate = ChainAcceptance(DRAFT_ALPHA if greedy else DRAFT_ALPHA_SAMPLED)
        self.ctrl.regain(self.chain_rate.gains(self.menu))
        self.choices = Counter()
        self.pending, self.last, self.rows = [], None, 0
        self.weighed = self.draft is None  # whether reading the prompt into the draft model was weighed yet
        for d in (self.ngram, self.draft):
            if d is not None:
                d.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return alone(self.drafting(ctx))

    def drafting(self, ctx: DecodeContext) -> Drafting:
        self.share(ctx)
        room = ctx.max_nodes
        if not self.weighed:
            self.weighed = True
            if not self.reading_pays(ctx):  # this request drafts without the draft model
                self.ctrl = self._controller([], ctx.params.greedy)
                self.share(ctx)
        ng = self.ngram.propose(ctx) if self.ngram is not None and room > 0 else DraftTree.empty()
        confs, parents = confidences(ng), ng.parents.tolist()
        gains = list(itertools.accumulate(self.cal.values(confs, parents)))
        choice = self.ctrl.choose(len(ng), room, len(ctx.tokens), gains)
        if len(ng):  # scored on what follows, whatever is verified now
            self.pending.append(_Pending(ng.tokens.tolist(), ng.children(), confs, len(ctx.tokens)))
        tree, drafted = DraftTree.empty(), None
        if choice.budget is not None:
            tree = drafted = yield from self.draft.drafting(ctx, choice.budget)
        if choice.chain and room > len(tree):
            part = ng.select(torch.arange(min(choice.chain, room - len(tree))))
            tree = tree.union(part) if len(tree) else part
        self.last = drafted
        self.choices[len(tree)] += 1
        self.rows, self.rows_ctx = 1 + min(len(tree), room), len(ctx.tokens)  # for the clock
        return tree

    def _controller(self, menu: list[tuple[TreeBudget, float]], greedy: bool) -> Controller:
        # a sampled draft-model chain carries its q: it cannot share a verify with point masses
        return Controller(menu, self.costs, 1.0, {}, union=greedy, hurdle=0.0)

    def reading_pays(self, ctx: DecodeContext) -> bool:
        """Whether the draft model's first chain pays for reading the context first: the seconds its best
        chain saves over the tokens the answer may still take (at most ctx.max_nodes + 1) against the rows
        it reads at Costs.catch_row_s, every sequence sharing the step waiting for them. Why: on a 4k-token
        prompt the Qwen 0.5B read for ~13 s to save ~2 s of a 256-token answer, and stalled the stream."""
        rows = len(ctx.tokens) - len(self.draft.cached)
        left = ctx.max_nodes + 1
        n = len(ctx.tokens)
        plain = self.ctrl.costs.target(1, n)
        best = min((secs / tokens for tokens, secs in (self.ctrl.expected(Choice(b, 0), 0, ctx.max_nodes, n)
                                                       for b, _ in self.menu)), default=plain)
        return rows * self.costs.catch_row_s * ctx.sharing < left * (plain - best)

    def end(self, answer: list[int]) -> None:
        if self.ngram is not None:
            self.ngram.end(answer)

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        if self.rows and self.clock is not None:
            if self.clock.note(ctx.forward_s, self.rows, self.rows_ctx):
                self.clock.settle(self.costs.target)
            self.rows = 0
        for d in (self.ngram, self.draft):
            if d is not None:
                d.accept(ctx, verdict)
        drafted, self.last = self.last, None
        self.ctrl.step()
        if drafted is not None and len(drafted) > 0:
            self.chain_rate.observe(matched(drafted, verdict.tokens), len(drafted))
            self.ctrl.regain(self.chain_rate.gains(self.menu))
        self.cal.step()
        keep = []
        for i, p in enumerate(self.pending):
            outcome, over = tried(p.children, p.tokens, ctx.tokens[p.start:])
            if over or len(self.pending) - i > MAX_PENDING:  # the oldest past the cap: what it showed so far
                for node, hit in outcome:
                    self.cal.observe(p.confs[node], hit)
            else:
                keep.append(p)
        self.pending = keep


def draft_menu() -> list[tuple[TreeBudget, float]]:
    """Draft-model chains as budgets (depth k, one child, k nodes) with their prior accepted tokens."""
    return [(TreeBudget(k, 1, k), sum(DRAFT_ALPHA ** i for i in range(1, k + 1))) for k in DRAFT_CHAINS]


def build_headless(target: Target, lookup: int | None, adaptive: bool, recalibrate: bool,
                   draft_vocab: int | None = DRAFT_VOCAB, draft_quant: DraftQuant = DRAFT_QUANT) -> Drafter:
    """`auto` for a target without an EAGLE head. lookup: n-gram draft nodes (None: NODES; 0: none);
    draft_vocab: the ids the draft model scores (0: all; None: no draft-model chains); draft_quant: the
    draft's blocks (draft_model.draft_runner)."""
    nodes = NODES if lookup is None else lookup
    if not adaptive:  # the static choice: method `ngram` as registered (lookup: its nodes)
        o = NgramOptions()
        return NgramDrafter(lookup or o.tree_size, o.topk, o.max_ngram, o.min_value) if nodes else NoDrafter()
    ngram = NgramDrafter(nodes, TOPK, min_value=MIN_VALUE) if nodes else None
    draft = None
    if target.draft_model is not None and draft_vocab is not None:
        draft = DraftModelDrafter(draft_runner(target, draft_vocab, draft_quant), target.runner.vocab_size)
    if ngram is None and draft is None:
        return NoDrafter()
    menu = draft_menu() if draft is not None else []

    costs, path, origin = load_plain_costs(target.runner, ngram, draft, menu, recalibrate)
    return HeadlessDrafter(ngram, costs, draft, menu, clock=StepClock(), origin=origin, cache=path)
