"""Adaptive speculation's choice (`auto`): every step, the option with the most expected tokens per second
under costs measured on this machine: a plain step, a model's draft from its menu (an EAGLE head's trees,
a draft model's chains), a prefix of the step's n-gram draft, or their union.

One acceptance estimate per drafter, learned online from earlier steps' verdicts only (lossless: a step's
draft never depends on its own verdict): a head's trees, the tuning table's expected tokens times a
decaying observed/expected ratio (TreeScale); a draft model's chains, a learned per-token alpha
(ChainRate); n-gram nodes, their raw confidence calibrated by what the emitted tokens showed (Calibration).
A union is priced by the share of the n-gram matches the model's draft did not match (Beyond).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from specdec.drafters.costs import Costs
from specdec.tree import TreeBudget

DECAY = 0.85  # per step, a head tree's evidence: halves in ~4 steps (text changes within an answer)
PRIOR_WEIGHT = 2.0  # the table's prior counts as this many expected accepted tokens
CAL_DECAY = 0.95  # per step, the n-gram calibration's: slower, each bucket sees fewer observations
CAL_PRIOR = 4.0  # a raw confidence counts as this many observations of its bucket
EDGES = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9)  # raw-confidence buckets of the calibration
ALPHA_PRIOR, ALPHA_DECAY = 4.0, 0.9  # a draft model's prior alpha counts as this many tokens; decay per chain
TIE = 0.995  # options within 0.5% of the best are ties: the cheapest (vanilla, then smaller drafts) wins
# a head's draft must promise this much more than a plain step. Why: the best of several estimated options
# is chosen, so its estimate runs high (the winner's curse): without it, on `tune`'s calibration prompts
# (SmolLM2, T = 0) the trees chosen took 1.69 tokens a step where 1.95 were expected, at 0.96x a plain step's rate
HURDLE = 0.05
BUCKET = 32  # contexts that share the plain-step bounds (t(1) moves ~0.3% over 32 tokens on SmolLM2)
# n-gram prefixes offered (and the whole draft): finer steps add options to price every step, not speed
PREFIXES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def prefixes(length: int, room: int) -> list[int]:
    top = min(length, room)
    return [m for m in PREFIXES if m < top] + [top] if top > 0 else []


def menu_from_tuning(rows: list[dict]) -> list[tuple[TreeBudget, float]]:
    """(budget, expected accepted tokens = tau - 1) from tune's acceptance table: per tree size the best
    tau at depth <= 4 and the best at depth 2 (cheaper to draft), never below a smaller size's best."""
    best: dict[tuple[int, bool], tuple[float, TreeBudget]] = {}
    for r in rows:
        b = TreeBudget(r["depth"], r["topk"], r["tree_size"])
        if b.depth > 4 or b.topk > 4:
            continue
        for shallow in {False, b.depth == 2}:
            if (b.tree_size, shallow) not in best or r["tau"] > best[b.tree_size, shallow][0]:
                best[b.tree_size, shallow] = (r["tau"], b)
    if not best:
        return [(TreeBudget(2, 3, 4), 0.9), (TreeBudget(3, 4, 8), 1.1)]
    # a larger tree accepts at least what the best smaller one does: a sampled table's lower estimate is noise
    menu = {b: max([tau - 1] + [t - 1 for t, s in best.values() if s.tree_size < b.tree_size])
            for tau, b in best.values()}
    return sorted(menu.items(), key=lambda x: (x[0].tree_size, x[0].depth))


@dataclass(frozen=True)
class Choice:
    budget: TreeBudget | None  # the model draft verified (None: none)
    chain: int  # n-gram draft nodes joined to the verify (0: none)

    @property
    def vanilla(self) -> bool:
        return self.budget is None and not self.chain


VANILLA = Choice(None, 0)


class TreeScale:
    """Observed over expected accepted tokens of a head's trees, decayed per step. A plain step pulls it
    toward the prior (a plain stretch ends with a try); each tree with nothing accepted halves that pull
    (down to an eighth): on text the head cannot follow, tries should come ever more rarely."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.num, self.den, self.misses = PRIOR_WEIGHT * prior, PRIOR_WEIGHT, 0

    @property
    def value(self) -> float:
        return self.num / self.den

    def step(self, observed: bool) -> None:
        w = PRIOR_WEIGHT * 0.5 ** min(self.misses, 3)
        self.num, self.den = DECAY * self.num, DECAY * self.den
        if not observed:  # a pull on every step too would weigh the prior like ~30% of the evidence
            self.num += (1 - DECAY) * w * self.prior
            self.den += (1 - DECAY) * w

    def observe(self, accepted: int, expected: float) -> None:
        self.num += accepted
        self.den += expected
        self.misses = 0 if accepted else self.misses + 1


class ChainRate:
    """P(a draft-model token is accepted | its parent was): a chain of k with m accepted shows m hits in
    min(m + 1, k) tries. Learned, not scaled: a draft accepting 0.9 a token makes long chains pay."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.hits, self.tries = ALPHA_PRIOR * prior, ALPHA_PRIOR

    def gains(self, menu: list[tuple[TreeBudget, float]]) -> dict[TreeBudget, float]:
        a = self.hits / self.tries
        return {b: sum(a ** i for i in range(1, b.depth + 1)) for b, _ in menu}

    def observe(self, accepted: int, drafted: int) -> None:
        d = ALPHA_DECAY
        self.hits = d * self.hits + (1 - d) * ALPHA_PRIOR * self.prior + accepted
        self.tries = d * self.tries + (1 - d) * ALPHA_PRIOR + min(accepted + 1, drafted)


class Calibration:
    """P(an n-gram node's token is emitted next | its parent's was) by raw-confidence bucket, decayed per
    step. Prior: `rates` where `specdec tune` measured them (tune/lookup.py), else the raw confidence
    times `scale` (at T > 0 a point mass x is accepted with p(x), not 1)."""

    def __init__(self, scale: float = 1.0, rates: list[float | None] | None = None) -> None:
        if rates is not None and len(rates) != len(EDGES) + 1:
            raise ValueError(f"one measured rate (or None) per calibration bucket: {len(EDGES) + 1}")
        self.scale, self.rates = scale, rates or [None] * (len(EDGES) + 1)
        self.hits = [0.0] * (len(EDGES) + 1)
        self.tries = [0.0] * (len(EDGES) + 1)

    def rate(self, conf: float) -> float:
        b = bisect.bisect_right(EDGES, conf)
        prior = self.rates[b] if self.rates[b] is not None else self.scale * conf
        return (self.hits[b] + CAL_PRIOR * prior) / (self.tries[b] + CAL_PRIOR)

    def gains(self, confs: list[float], parents: list[int]) -> list[float]:
        """Expected accepted tokens of the draft's first m nodes, m = 1..len (best first: each prefix a tree)."""
        value: list[float] = []
        out, total = [], 0.0
        for c, p in zip(confs, parents):
            value.append((value[p] if p >= 0 else 1.0) * self.rate(c))
            total += value[-1]
            out.append(total)
        return out

    def observe(self, conf: float, hit: bool) -> None:
        b = bisect.bisect_right(EDGES, conf)
        self.hits[b] += hit
        self.tries[b] += 1.0

    def step(self) -> None:
        self.hits = [CAL_DECAY * h for h in self.hits]
        self.tries = [CAL_DECAY * t for t in self.tries]


class Beyond:
    """The decaying share of an n-gram draft's matched tokens that the model draft beside it did not match:
    what their union adds. Prior: half, worth one matched token."""

    def __init__(self) -> None:
        self.beyond = self.matched = 0.0

    @property
    def share(self) -> float:
        return (self.beyond + 0.5) / (self.matched + 1.0)

    def observe(self, matched: int, model_matched: int) -> None:
        self.beyond = CAL_DECAY * self.beyond + max(0, matched - model_matched)
        self.matched = CAL_DECAY * self.matched + matched


class Policy:
    """The per-step choice over a menu of model drafts ((budget, expected accepted tokens before `scale`)
    priced by `draft_s` (default costs.draft_s) + costs.follow_s, the n-gram draft's prefixes, and their
    unions if `union` (both drafts point masses)."""

    def __init__(self, menu: list[tuple[TreeBudget, float]], costs: Costs, draft_s: dict | None = None,
                 union: bool = True, hurdle: float = 0.0) -> None:
        self.union, self.hurdle = union, hurdle
        self.draft_s = costs.draft_s if draft_s is None else draft_s
        self.follow_s = costs.follow_s
        self.gain = dict(menu)
        self.menu = list(self.gain.items())
        self.widest = max((b.tree_size for b in self.gain), default=0)
        self.reprice(costs)

    def reprice(self, costs: Costs) -> None:
        self.costs, self._times, self._bounds = costs, {}, {}

    def regain(self, gains: dict[TreeBudget, float]) -> None:
        self.gain = {b: gains.get(b, g) for b, g in self.gain.items()}
        self.menu, self._bounds = list(self.gain.items()), {}

    def plain_bounds(self, ctx: int, look: float) -> tuple[list[float], float, float]:
        """For ctx's bucket of BUCKET contexts, ([K_i], C, P): menu draft i, with an n-gram part adding G
        tokens, cannot beat a plain step if scale * g_i + G < K_i + P * catch_up (P: a plain step's tokens
        per second); an n-gram prefix alone cannot below C tokens. Bounds: a plain step priced at the
        bucket's end, the others at its start without the n-gram rows (t(n) never falls as either grows)."""
        lo = ctx - ctx % BUCKET
        got = self._bounds.get((lo, look))
        if got is None:
            c = self.costs
            plain = (1.0 + self.hurdle) / (look + c.target(1, lo + BUCKET - 1))
            bars = [plain * (look + self.draft_s[b] + self.follow_s + c.target(1 + b.tree_size, lo)) - 1.0
                    for b in self.gain]
            got = self._bounds[lo, look] = (bars, plain * (look + c.target(2, lo)) - 1.0, plain)
        return got

    def times(self, ctx: int | None, rows: int) -> list[float]:
        """[t(n) for n < at least rows] at the middle of ctx's bucket of BUCKET contexts (None: at the
        measured context): one list per bucket instead of a call per option and step."""
        key = None if ctx is None else ctx - ctx % BUCKET + BUCKET // 2
        got = self._times.get(key)
        if got is None or len(got) < rows:
            got = self._times[key] = [0.0] + [self.costs.target(n, key) for n in range(1, max(rows, 34 + self.widest))]
        return got

    def _priced(self, gains: list[float], room: int, ctx: int | None, scale: float, catch_up: float, beyond: float,
                look: float, keep, lengths: list[int], alone: bool = True, prune: bool = False) -> list[tuple]:
        """[(expected tokens, seconds, rank, budget, chain)]: the plain step, the menu drafts `keep` indexes,
        the n-gram prefixes of `lengths` nodes (if `alone`) and their unions with each (`prune`: only those
        that can win and add tokens). Rank orders ties: vanilla, the menu, the prefixes, the unions."""
        t = self.times(ctx, 2 + self.widest + (lengths[-1] if lengths else 0))
        out = [(1.0, look + t[1], 0, None, 0)]
        trees = []
        for i in keep:
            b, g = self.menu[i]
            nodes = min(b.tree_size, room)
            tree, secs = scale * g * nodes / b.tree_size, look + self.draft_s[b] + self.follow_s + catch_up
            trees.append((i, b, nodes, tree, secs))
            out.append((1.0 + tree, secs + t[1 + nodes], i + 1, b, 0))
        k = len(self.menu) + 1
        if alone:
            out += [(1.0 + min(float(m), gains[m - 1]), look + t[1 + m], k * (j + 1), None, m)
                    for j, m in enumerate(lengths)]
        if not self.union or not lengths:
            return out
        band = max([(1.0 + self.hurdle) / out[0][1]] + [o[0] / o[1] for o in out[1:]]) * TIE if prune else 0.0
        for i, b, nodes, tree, secs in trees:
            top = min(lengths[-1], room - nodes)
            if top <= 0:
                continue
            g = gains[top - 1]
            # the union's best case (the whole draft) at its cheapest (one row more) under the band: none of
            # this tree's unions can win, and most steps price none
            if (1.0 + tree + min(float(top), max(0.0, g - tree, beyond * g))) / (secs + t[2 + nodes]) < band:
                continue
            for j, m in enumerate(lengths):
                n = min(m, room - nodes)
                g = gains[n - 1]
                add = min(float(n), max(0.0, g - tree, beyond * g))
                if add > 0 or not prune:
                    out.append((1.0 + tree + add, secs + t[1 + nodes + n], k * (j + 1) + i + 1, b, m))
        return out

    def expected(self, choice: Choice, gains: list[float], room: int, ctx: int | None = None, scale: float = 1.0,
                 catch_up: float = 0.0, beyond: float = 0.0, look: float = 0.0) -> tuple[float, float]:
        """(expected tokens, seconds) of one step with this choice, as choose() prices it; gains[m - 1]: the
        n-gram draft's first m nodes' expected accepted tokens; catch_up: what a head pays first to read the
        rows of steps it skipped; look: the n-gram draft's own cost (paid either way)."""
        b = choice.budget
        chain = max(0, min(choice.chain, room - (min(b.tree_size, room) if b else 0)))
        keep = [i for i, (x, _) in enumerate(self.menu) if x == b]
        opts = self._priced(gains, room, ctx, scale, catch_up, beyond, look, keep, [chain] if chain else [])
        return next((o[0], o[1]) for o in opts if o[3] == b and o[4] == chain)

    def choose(self, gains: list[float], room: int, ctx: int | None = None, scale: float = 1.0,
               catch_up: float = 0.0, beyond: float = 0.0, look: float = 0.0) -> Choice:
        """The option with the most expected tokens per second (a plain step's raised by the hurdle), each
        priced as expected() prices it."""
        if room <= 0:
            return VANILLA
        menu = self.menu
        keep, alone = range(len(menu)), True  # the menu drafts and whether n-gram prefixes alone are priced
        if ctx is not None and room >= self.widest and self.costs.attend_s >= 0:
            # most steps: only what plain_bounds cannot rule out (on text that drafts nothing, pricing every
            # option was most of what `auto` added to a step)
            bars, least, plain = self.plain_bounds(ctx, look)
            whole = gains[min(len(gains), room) - 1] if gains else 0.0
            # a head's catch-up after plain steps: what rules most of its trees out on text it cannot follow
            extra = plain * catch_up - (whole if self.union else 0.0)
            keep = [i for i, k in enumerate(bars) if scale * menu[i][1] >= k + extra]
            alone = whole >= least
            if not keep and not alone:
                return VANILLA
        opts = self._priced(gains, room, ctx, scale, catch_up, beyond, look, keep, prefixes(len(gains), room), alone,
                            prune=True)
        plain = (1.0 + self.hurdle) / opts[0][1]
        best = max(plain, max(o[0] / o[1] for o in opts[1:]) if len(opts) > 1 else 0.0) * TIE
        if plain >= best:
            return VANILLA
        _, _, _, b, m = min((o for o in opts[1:] if o[0] / o[1] >= best), key=lambda o: o[2])
        return Choice(b, m)
