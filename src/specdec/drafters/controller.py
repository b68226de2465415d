"""The per-step choice of adaptive speculation (`auto`): which draft to verify, or none, for the most
expected tokens per second under measured costs. Pure arithmetic over estimates that read only verdicts
of earlier steps, so a step's draft never depends on its own verdict (lossless); unit-tested on its own."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.drafters.costs import Costs
from specdec.tree import TreeBudget

DECAY = 0.85  # per step: an observation's weight halves in ~4 steps
# per step, for what lookup chains matched: their weight halves in ~14 steps. Why slower: a chain is
# followed for free when not verified, so evidence keeps coming on text that repeats; on text that does
# not, a few misses must hold for a while (the README demo prompt: 14 short chains in 73 steps, 3 tokens
# accepted, 0.95x vanilla at DECAY)
CHAIN_DECAY = 0.95
PRIOR_WEIGHT = 2.0  # the prior counts as this many expected accepted tokens
# a lookup chain's prior counts as this many chains. Why not 1: one sampled 1-gram chain that matched (of
# a prior 0.15) priced the next at 0.54, and the tries that followed matched nothing
PRIOR_CHAINS = 4.0
TEXT_WEIGHT = 0.25  # ... and for the chains of a text, as this many matched tokens (the README demo
# prompt, whose answer repeats no phrase: 0.93x vanilla at 2, 0.95 at 1, 0.98 at 0.5, 1.00 at 0.25; MT-bench,
# summarization and QA prompts unchanged)
# a lookup chain's prior by the n-gram length it matched: P(its first i tokens all match), i = 1..12.
# Measured with scripts/chain_stats.py on SmolLM2-135M-Instruct's vanilla answers (192 tokens) to 20
# hand-written prompts and 40 GSM8K-train questions (no benchmark prompt): 10k steps per temperature.
# Greedy 3-gram chains run long (answers that restate the question); sampled ones stop after ~2 tokens.
LOOKUP_PRIOR = {
    1: (.272, .153, .094, .062, .048, .034, .027, .018, .014, .012, .011, .009),
    2: (.564, .334, .216, .156, .104, .083, .061, .049, .042, .039, .033, .028),
    3: (.748, .600, .506, .434, .383, .348, .318, .295, .274, .256, .242, .230),
}
LOOKUP_PRIOR_SAMPLED = {  # T = 1
    1: (.148, .047, .022, .011, .005, .003, .002, .001),
    2: (.320, .149, .065, .037, .025, .016, .010, .005, .004, .002),
    3: (.507, .276, .169, .108, .066, .042, .028, .016, .008, .004),
}
# a draft must promise this much more than a plain step. Why: near break-even the estimates' errors and
# the retries after plain steps cost more than drafting gains; measured on SmolLM2 (the README demo
# prompt drafted 2-node trees that accepted 0.33 tokens against a break-even of 0.35: 0.94x vanilla)
HURDLE = 0.05
BUCKET = 32  # contexts that share plain_bounds (t(1) moves ~0.3% over 32 tokens on SmolLM2)
# chain prefixes offered (and the whole chain): finer steps add options to price every step, not speed
PREFIXES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def prefixes(chain_len: int, room: int) -> list[int]:
    """The chain lengths a step may verify."""
    top = min(chain_len, room)
    return [m for m in PREFIXES if m < top] + [top] if top > 0 else []


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


class ChainEstimate:
    """What lookup chains matched after one n-gram length: per position i, the decayed share of chains
    whose first i tokens all matched (among those that reached i); and of the tokens they matched on
    steps that verified a head tree too, the share beyond the tree's (what a tree + chain gains over
    the tree). The prior counts as PRIOR_CHAINS chains per position, and as one chain's tokens (half
    beyond a tree) in that share. The steps' decay toward the prior is applied when the estimate is next
    read or updated (its closed form): a plain step pays nothing for it."""

    def __init__(self, prior: tuple[float, ...], now: int) -> None:
        self.prior = prior
        self.hits = [PRIOR_CHAINS * p for p in prior]
        self.seen = [PRIOR_CHAINS] * len(prior)
        self.mean = sum(prior)
        self.both = [0.5 * self.mean, self.mean]  # (tokens beyond the tree's, tokens matched), decayed
        self.at = now

    def _catch_up(self, now: int, decay: float) -> None:
        if now != self.at:
            d = decay ** (now - self.at)
            p = 1.0 - d
            self.hits = [d * h + p * PRIOR_CHAINS * q for h, q in zip(self.hits, self.prior)]
            self.seen = [d * s + p * PRIOR_CHAINS for s in self.seen]
            self.both = [d * self.both[0] + p * 0.5 * self.mean, d * self.both[1] + p * self.mean]
            self.at = now

    def beyond(self, now: int, decay: float) -> float:
        """The share of a chain's matched tokens that a head tree verified beside it did not match."""
        self._catch_up(now, decay)
        b, m = self.both
        return b / m if m > 0 else 0.5

    def gains(self, length: int, now: int, decay: float) -> list[float]:
        """Expected matched tokens of the chain's first m tokens, m = 1..length."""
        self._catch_up(now, decay)
        out, total = [], 0.0
        last = self.hits[-1] / self.seen[-1] if self.hits else 0.0
        for i in range(length):
            # past the longest chain seen or priced: the last position's rate, decaying further
            total += self.hits[i] / self.seen[i] if i < len(self.hits) else last * 0.5 ** (i - len(self.hits) + 1)
            out.append(total)
        return out

    def bound(self, length: int) -> float:
        """At least gains(length)[-1] at this or any later step before the next observation, cheaply: the
        decay only moves each position's rate from hits / seen toward the prior, so it stays under the
        larger of the two; past the positions kept, the rates halve from the last one's (their sum < it)."""
        top = [max(h / s, q) if s > 0 else q for h, s, q in zip(self.hits, self.seen, self.prior)]
        total = sum(top[:length])
        return min(float(length), total + top[-1] if length > len(top) and top else total)

    def observe(self, matched: int, length: int, now: int, decay: float, tree: int | None = None) -> None:
        """A chain of `length` tokens whose first `matched` tokens matched (it says nothing past its length);
        tree: what a head tree verified on the step it was drafted matched (None: no tree)."""
        self._catch_up(now, decay)
        if tree is not None:
            self.both[0] += max(0, matched - tree)
            self.both[1] += matched
        if length > len(self.hits):
            self.prior = self.prior + (0.0,) * (length - len(self.prior))
            self.hits += [0.0] * (length - len(self.hits))
            self.seen += [0.0] * (length - len(self.seen))
        for i in range(length):
            self.hits[i] += i < matched
            self.seen[i] += 1.0


class Controller:
    """The per-request estimates and the per-step choice.

    Tree: a decaying ratio of observed to expected accepted tokens scales the table's gains. Chain: the
    caller passes `gains` (gains[m - 1]: expected accepted tokens of the chain's first m nodes), so every
    prefix is an option, and `beyond`, the share of them a tree verified beside the chain would not
    have matched (None: the larger of the two parts, a lower bound). For a lookup chain, `chain_gains`
    and `chain_beyond` give them per n-gram length it matched (a 3-gram match predicts far better than a
    1-gram one). `draft_s`: what each menu budget's propose() costs (default: the top-k trees' costs)."""

    def __init__(self, menu: list[tuple[TreeBudget, float]], costs: Costs, scale: float,
                 lookup_prior: dict[int, tuple[float, ...]] | None = None, decay: float = DECAY,
                 prior_weight: float = PRIOR_WEIGHT, draft_s: dict[TreeBudget, float] | None = None,
                 union: bool = True, hurdle: float = HURDLE) -> None:
        self.menu, self.costs, self.decay, self.union, self.hurdle = menu, costs, decay, union, hurdle
        self.draft_s = costs.draft_s if draft_s is None else draft_s
        self.gain = dict(menu)
        self.scale_prior, self.weight = scale, prior_weight
        self.num, self.den = prior_weight * scale, prior_weight  # tree: decayed observed / expected tokens
        self.misses = 0  # head trees in a row that had nothing accepted
        self.now = 0  # steps taken
        self.chain = {n: ChainEstimate(tail, 0) for n, tail in (lookup_prior or {}).items()}
        # this text's chains: decayed matched / expected tokens over all n-gram lengths, updated when read
        self.text = [TEXT_WEIGHT, TEXT_WEIGHT, 0]
        self.widest = max((b.tree_size for b, _ in menu), default=0)
        self._bars: dict[tuple[int, bool], tuple] = {}  # (context bucket, lookup) -> plain_bounds
        self._trees = [(b, b.tree_size, g, self.draft_s[b] + costs.follow_s) for b, g in menu]
        self._base: list[float] = []  # target(n) at the measured context (_times)
        self.sharing = 1  # the sequences sharing each forward that `costs` prices rows for (Costs.shared)

    def reprice(self, costs: Costs, sharing: int) -> None:
        """Price the options by these forward costs from now on (drafting's stay)."""
        self.costs, self.sharing, self._bars, self._base = costs, sharing, {}, []
        self._trees = [(b, b.tree_size, g, self.draft_s[b] + costs.follow_s) for b, g in self.menu]

    def regain(self, gains: dict[TreeBudget, float]) -> None:
        """New expected accepted tokens per menu tree (before the scale), e.g. from a learned per-token rate."""
        self.menu = [(b, gains.get(b, g)) for b, g in self.menu]
        self.gain = dict(self.menu)
        self._trees = [(b, size, self.gain[b], df) for b, size, _, df in self._trees]
        self._bars = {}

    def surely_plain(self, room: int, ctx: int | None, catch_up: float = 0.0, chain: float = 0.0) -> bool:
        """Whether the step is a plain one without pricing its options: no option beats a plain step by the
        bounds of the context's bucket (plain_bounds). chain: the lookup chain's expected matched tokens,
        whole (0: no chain); catch_up: what a head tree pays first. Exact: a cheap test that skips `choose`'s
        pricing on most steps of text that drafts nothing, and on it they were most of what `auto` added."""
        if ctx is None or room < self.widest or self.costs.attend_s < 0:
            return False
        plain, chain_k, bar, bars = self.plain_bounds(ctx, chain > 0)
        if chain > 0 and chain >= chain_k:
            return False
        scale, more = self.scale, plain * catch_up - chain
        if more >= 0 and scale < bar:  # the bar without catch-up and chain holds (most plain steps)
            return True
        return all(scale * g < k + more for g, k in bars)

    def plain_bounds(self, ctx: int, look: bool) -> tuple[float, float, float, list[tuple[float, float]]]:
        """For ctx's bucket of BUCKET contexts, with or without a lookup: (P, C, bar, [(g, K) per menu tree])
        where P is the plain step's rate priced at the bucket's end, a chain alone cannot beat it if its
        expected tokens are under C, tree b (with any chain of expected tokens G, catch-up c) cannot if
        scale * g + G < K + P * c, and bar = min K / g (no tree can if scale < bar, G = c = 0). Options are
        priced at the bucket's start and without the chain's rows: bounds, because t(n) never falls as n or
        the context grow (attend_s >= 0)."""
        lo = ctx - ctx % BUCKET
        got = self._bars.get((lo, look))
        if got is None:
            c = self.costs
            ls = c.lookup_s if look else 0.0
            plain = (1.0 + self.hurdle) / (ls + c.target(1, lo + BUCKET - 1))
            bars = [(g, plain * (ls + self.draft_s[b] + c.follow_s + c.target(1 + b.tree_size, lo)) - 1.0)
                    for b, g in self.menu]
            bar = -float("inf") if any(g <= 0 and k <= 0 for g, k in bars) else \
                min((k / g for g, k in bars if g > 0), default=float("inf"))
            got = self._bars[(lo, look)] = (plain, plain * (ls + c.target(2, lo)) - 1.0, bar, bars)
        return got

    def _times(self, ctx: int | None, rows: int) -> list[float]:
        """[target(n, ctx) for n < rows]: one list a step instead of a call per option."""
        c = self.costs
        if len(self._base) < rows:
            self._base = [0.0] + [c.target(n) for n in range(1, rows)]
        if ctx is None or not c.attend_s:
            return self._base
        a, d = c.attend_s, ctx - c.ctx
        return [max(x + n * a * d, 0.25 * x) for n, x in enumerate(self._base[:rows])]

    @property
    def scale(self) -> float:
        return self.num / self.den

    def chain_gains(self, ngram: int, length: int) -> list[float]:
        """Expected matched tokens of a lookup chain's first m tokens (m = 1..length) after this n-gram:
        its estimate times how this text's chains fared against theirs (one n-gram's misses warn of another's:
        the README demo prompt's answer repeats no phrase, and its 1-, 2- and 3-gram chains failed alike)."""
        est = self.chain.get(ngram)
        if est is None:
            return [0.0] * length
        r, out, last, total = self.text_ratio(), [], 0.0, 0.0
        for g in est.gains(length, self.now, CHAIN_DECAY):  # each position's chance, scaled, at most 1
            total += min(1.0, (g - last) * r)
            last = g
            out.append(total)
        return out

    def text_ratio(self) -> float:
        """Matched over expected tokens of this text's chains, at most 1: misses warn of other n-grams' chains,
        but a hit already raises its own n-gram's estimate, and counted twice one lucky token doubled every
        price (sampled translation: 1-gram chains verified at 1.4x their worth, none accepted)."""
        num, den, at = self.text
        if at != self.now:
            d = CHAIN_DECAY ** (self.now - at)
            num, den = d * num + (1 - d) * TEXT_WEIGHT, d * den + (1 - d) * TEXT_WEIGHT
            self.text = [num, den, self.now]
        return min(1.0, num / den)

    def chain_bound(self, ngram: int, length: int) -> float:
        """At least chain_gains(ngram, length)[-1] at this step, for surely_plain before the chain is priced:
        on text whose chains keep missing (the README demo prompt, sampled RAG) most steps find a chain, and
        pricing it cost ~40 us a step. Each position's share there is min(1, rate * text_ratio)."""
        est = self.chain.get(ngram)
        return 0.0 if est is None else est.bound(length) * self.text_ratio()

    def chain_beyond(self, ngram: int) -> float:
        est = self.chain.get(ngram)
        return est.beyond(self.now, CHAIN_DECAY) if est is not None else 0.5

    def added(self, alone: float, tree: float, beyond: float | None) -> float:
        """Expected tokens a chain part matching `alone` adds to a tree's `tree`: at least what makes the
        union worth its better part."""
        return max(0.0, alone - tree, 0.0 if beyond is None else beyond * alone)

    def expected(self, choice: Choice, chain_len: int, room: int, ctx: int | None = None,
                 gains: list[float] | None = None, catch_up: float = 0.0,
                 beyond: float | None = None) -> tuple[float, float]:
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
            alone = gains[n - 1] if n > 0 else 0.0
            extra = min(float(n), self.added(alone, tree, beyond) if choice.budget is not None else alone)
            nodes += n
        return 1.0 + tree + extra, secs + c.target(1 + nodes, ctx)

    def choose(self, chain_len: int, room: int, ctx: int | None = None, gains: list[float] | None = None,
               catch_up: float = 0.0, beyond: float | None = None) -> Choice:
        """chain_len: nodes of this step's chain draft (0: none), its `prefixes` options priced by `gains`.
        The options are vanilla, each menu tree, and per prefix the chain alone and each tree + chain whose
        chain adds something (`added`), priced as `expected` prices them (the same
        arithmetic, inlined: this runs every step, and on text that drafts nothing it is most of what
        `auto` adds to a step)."""
        if room <= 0:
            return VANILLA
        c, scale = self.costs, self.scale
        if self.surely_plain(room, ctx, catch_up, gains[min(chain_len, room) - 1] if chain_len else 0.0):
            return VANILLA
        look = c.lookup_s if chain_len else 0.0
        lengths = prefixes(chain_len, room)
        t = self._times(ctx, 2 + self.widest + (lengths[-1] if lengths else 0))  # t[n]: target(n, ctx)
        # per menu tree: (budget, nodes, expected tree tokens, seconds before the forward)
        trees = []
        # (rate, rank, budget, chain): rank orders the options as listed above, ties going to the earliest
        rates = [(1.0 / (look + t[1]) * (1 + self.hurdle), 0, None, 0)]
        for i, (b, size, g, df) in enumerate(self._trees):
            nodes = size if size <= room else room
            tree, secs = scale * g * nodes / size, look + (df + catch_up)
            trees.append((b, nodes, tree, secs))
            rates.append(((1.0 + tree) / (secs + t[1 + nodes]), i + 1, b, 0))
        k = len(trees) + 1
        rates += [((1.0 + min(float(m), gains[m - 1])) / (look + t[1 + m]), k * (j + 1), None, m)
                  for j, m in enumerate(lengths)]
        if self.union and lengths:
            band, most, bz = max(r[0] for r in rates) * 0.995, lengths[-1], 0.0 if beyond is None else beyond
            for i, (b, nodes, tree, secs) in enumerate(trees):
                top = min(most, room - nodes)
                if top <= 0:
                    continue
                # no union with this tree is within the ties' band of the best (a wider forward never costs
                # less): most steps' unions go unpriced. `added` inlined, as below
                alone = gains[top - 1]
                if (1.0 + tree + min(float(top), max(0.0, alone - tree, bz * alone))) / (secs + t[2 + nodes]) < band:
                    continue
                for j, m in enumerate(lengths):
                    n = min(m, room - nodes)
                    if n > 0:
                        alone = gains[n - 1]
                        add = min(float(n), max(0.0, alone - tree, bz * alone))
                        if add > 0:
                            rates.append(((1.0 + tree + add) / (secs + t[1 + nodes + n]), k * (j + 1) + i + 1, b, m))
        best = max(r[0] for r in rates)
        # ties (within 0.5%) go to the cheapest option: vanilla first, then smaller trees
        r, _, b, m = min((x for x in rates if x[0] >= best * 0.995), key=lambda x: x[1])
        return VANILLA if b is None and not m else Choice(b, m)

    def step(self, tree_observed: bool = False) -> None:
        """Every step decays the evidence. A step that verified no head tree also pulls the tree estimate
        toward its prior (so a stretch of plain steps ends with a try); one that did adds its observation
        instead. Why not both: a pull on every step weighs the prior like ~30% of the evidence, so a
        stretch of text accepting half the table's tokens read as 0.66 of it and kept drafting at a loss.
        Each try in a row that had nothing accepted halves the pull (down to an eighth): on text the head
        cannot follow the tries were pure loss (Spec-Bench QA at T = 1: 4-7 tries in 81 steps, none
        accepted, 0.95x vanilla). The chain estimates decay when next read (ChainEstimate)."""
        d, w = self.decay, self.weight * 0.5 ** min(self.misses, 3)
        self.num, self.den = d * self.num, d * self.den
        if not tree_observed:
            self.num += (1 - d) * w * self.scale_prior
            self.den += (1 - d) * w
        self.now += 1

    def observe_tree(self, accepted: int, expected: float) -> None:
        self.num += accepted
        self.den += expected
        self.misses = 0 if accepted else self.misses + 1

    def observe_chain(self, ngram: int, matched: int, length: int, tree: int | None = None) -> None:
        """A lookup chain of `length` tokens after this n-gram matched its first `matched` tokens; tree:
        what the head tree verified on its step matched (None: none was)."""
        est = self.chain.get(ngram)
        if est is None:
            est = self.chain[ngram] = ChainEstimate((), self.now)
        expected = est.gains(length, self.now, CHAIN_DECAY)[-1] if length else 0.0
        self.text_ratio()  # brought up to now
        self.text[0] += matched
        self.text[1] += expected
        est.observe(matched, length, self.now, CHAIN_DECAY, tree)
