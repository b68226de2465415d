"""Adaptive speculation: every step, the draft that maximises expected tokens per second under costs
measured on this machine, including no draft at all (a plain vanilla step).

Two models, kept apart because only one of them travels:
- acceptance (machine-independent; `specdec tune` measures it by exact greedy replay and ships it with
  the head): the greedy tau of each EAGLE-2 tree budget on calibration text;
- costs (machine-dependent; measured here in ~2 s at first use, cached per CPU, cores, threads, torch,
  target, precision and head; `recalibrate` re-measures): t(N) of the target, each budget's draft time,
  the head's catch-up after a step, the prompt lookup.

Online, per request, a decaying ratio of observed to expected accepted tokens scales the table (text
gets easier or harder within an answer: lists, repeats, code), and a decaying mean of the lookup
chain's matched length prices the chain. Without observations both drift back to their priors, so a
stretch of vanilla steps ends with a try. Both read only verdicts of earlier steps, and the costs are
fixed for the Decoder: a step's draft never depends on that step's verdict (lossless, greedy and
sampled) and a seeded sampled request gives the same text every time on this machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.files import atomic_write_text, cache_dir
from specdec.machine import cpu_name, forward_costs, usable_cpus
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeBudget
from specdec.verify import Verdict, greedy_walk

# forward sizes timed besides 1 + each menu tree's size; others are interpolated. Not assumed monotone:
# measured on an AMD EPYC (SmolLM2, 2 threads), t(2) = 37 ms > t(5) = 32 ms > t(1) = 30 ms
ANCHORS = (1, 2, 3, 5, 9, 13, 17, 25, 33)
DECAY = 0.85  # per step: an observation's weight halves in ~4 steps
PRIOR_WEIGHT = 2.0  # the prior counts as this many expected accepted tokens
SAMPLED_SCALE = 0.55  # prior for T > 0 when the table has none: shipped head, alpha_1 0.35 at T=1 vs 0.64 greedy
# prior matched tokens of a lookup chain by the n-gram length it matched (greedy; sampled: half)
LOOKUP_PRIOR = {1: 0.5, 2: 1.0, 3: 1.5}


@dataclass
class Costs:
    """Seconds, measured on this machine: target forwards by row count, each budget's propose(), the
    head's catch-up, one lookup."""

    target_s: dict[int, float]
    draft_s: dict[TreeBudget, float]
    follow_s: float
    lookup_s: float

    def target(self, n: int) -> float:
        """t(n), linear between the measured sizes (and beyond the last, along the last segment)."""
        if n in self.target_s:
            return self.target_s[n]
        xs = self.sizes
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=xs[-1])
        if hi == lo:
            lo, hi = xs[-2], xs[-1]
        t0, t1 = self.target_s[lo], self.target_s[hi]
        return t0 + (t1 - t0) * (n - lo) / (hi - lo)

    @functools.cached_property
    def sizes(self) -> list[int]:  # sorted once: target() runs for every option of every step
        return sorted(self.target_s)

    def to_json(self) -> dict:
        return {"target_ms": {str(n): round(t * 1e3, 4) for n, t in self.target_s.items()},
                "draft_ms": [[b.depth, b.topk, b.tree_size, round(t * 1e3, 4)] for b, t in self.draft_s.items()],
                "follow_ms": round(self.follow_s * 1e3, 4), "lookup_ms": round(self.lookup_s * 1e3, 4)}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        return cls({int(n): t / 1e3 for n, t in d["target_ms"].items()},
                   {TreeBudget(a, b, c): t / 1e3 for a, b, c, t in d["draft_ms"]}, d["follow_ms"] / 1e3,
                   d["lookup_ms"] / 1e3)


def menu_from_tuning(rows: list[dict]) -> list[tuple[TreeBudget, float]]:
    """(budget, greedy expected accepted tokens = tau - 1) per tree size, from tune's acceptance table
    (tuning.load_acceptance): for each size the best tau at depth <= 4 and the best at depth 2 (cheaper
    to draft)."""
    best: dict[tuple[int, bool], tuple[float, TreeBudget]] = {}
    for r in rows:
        b = TreeBudget(r["depth"], r["topk"], r["tree_size"])
        if b.depth > 4 or b.topk > 4:
            continue
        for shallow in {False, b.depth == 2}:
            key = (b.tree_size, shallow)
            if key not in best or r["tau"] > best[key][0]:
                best[key] = (r["tau"], b)
    menu = {b: tau - 1 for tau, b in best.values()}
    if not menu:
        menu = {TreeBudget(2, 3, 4): 0.9, TreeBudget(3, 4, 8): 1.1}
    return sorted(menu.items(), key=lambda x: (x[0].tree_size, x[0].depth))


def cost_key(runner, head_dir: str | None, menu: list[tuple[TreeBudget, float]], lookup: int) -> dict:
    cfg = getattr(runner, "config", None)
    return {"cpu": cpu_name(), "usable_cpus": usable_cpus(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "target": str(getattr(cfg, "_name_or_path", "")),
            "target_shape": [getattr(cfg, "hidden_size", 0), getattr(cfg, "num_hidden_layers", 0),
                             getattr(runner, "vocab_size", 0)],
            "dtype": str(runner.dtype), "weights": getattr(runner, "weights", ""), "device": str(runner.device),
            "kernel": getattr(runner, "decode_kernel", ""),
            "kernel_build": getattr(runner, "kernel_build", ""), "head": Path(head_dir).name if head_dir else "",
            "menu": [list(b.__dict__.values()) for b, _ in menu],
            "lookup": lookup}


@torch.inference_mode()
def measure_costs(runner, drafter: EagleDrafter, menu: list[tuple[TreeBudget, float]], lookup: int,
                  reps: int = 3, ctx_len: int = 384) -> Costs:
    """~2.5 s for SmolLM2-135M on 2 cores: t(N) for every menu tree and at the anchors up to the largest
    tree + chain, then each budget's propose() and the head's catch-up, at a ctx_len-token context."""
    top = max(b.tree_size for b, _ in menu) + lookup + 1
    sizes = sorted({n for n in ANCHORS if n < top} | {1 + b.tree_size for b, _ in menu} | {top})
    target_s = forward_costs(runner, sizes, reps, ctx=ctx_len, stat=min)  # min: the least disturbed repetition
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(runner.vocab_size, 1000), (ctx_len + 16,), generator=g).tolist()
    runner.reset()
    feats = runner.forward(torch.tensor(ids), logits_rows=slice(-1, None)).features
    runner.reset()
    ctx = DecodeContext(ids[:ctx_len + 1], SamplingParams(), None, ctx_len, feats[:ctx_len])
    drafter.begin(ctx)
    draft_s = {}
    for b, _ in menu:
        ts = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            drafter.propose(ctx, b)
            ts.append(time.perf_counter() - t)
        draft_s[b] = min(ts[1:])
    follow = []
    for i in range(reps + 1):  # a typical step: one accepted token + the bonus
        ctx.tokens += ids[ctx_len + 1 + 2 * i:ctx_len + 3 + 2 * i]
        ctx.features = feats[ctx_len + 2 * i:ctx_len + 2 + 2 * i]
        drafter.accept(ctx, Verdict([0], ctx.tokens[-2:], ctx.tokens[-1]))
        t = time.perf_counter()
        drafter.sync(ctx)
        follow.append(time.perf_counter() - t)
    pld = PromptLookupDrafter(chain_len=max(lookup, 1))
    look = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        pld.propose(ctx)
        look.append(time.perf_counter() - t)
    drafter.runner.reset()  # every request begins afresh anyway
    return Costs(target_s, draft_s, min(follow[1:]), min(look[1:]))


def cost_file(key: dict, prefix: str = "") -> Path:
    """Where a cost measurement for exactly this key is cached (one file per key digest)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{prefix}{digest}.json"


def read_cost_file(path: Path, key: dict) -> dict | None:
    """The cached record if it was measured for this key; None if missing or damaged (measured again)."""
    try:
        rec = json.loads(path.read_text())
        return rec if isinstance(rec, dict) and rec.get("key") == key else None
    except (OSError, ValueError):
        return None


def write_cost_file(path: Path, key: dict, **fields) -> None:
    atomic_write_text(path, json.dumps({"key": key, **fields, "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                       indent=1) + "\n")


def load_costs(runner, drafter: EagleDrafter, head_dir: str | None, menu: list[tuple[TreeBudget, float]],
               lookup: int, recalibrate: bool = False) -> tuple[Costs, Path, bool]:
    """(costs, cache file, measured now?): this machine's cached measurement for exactly this key, else a
    new one (written atomically)."""
    key = cost_key(runner, head_dir, menu, lookup)
    path = cost_file(key)
    rec = None if recalibrate else read_cost_file(path, key)
    if rec is not None:
        try:
            return Costs.from_json(rec["costs"]), path, False
        except (KeyError, TypeError, ValueError):
            pass  # a damaged cache entry is measured again
    costs = measure_costs(runner, drafter, menu, lookup)
    write_cost_file(path, key, costs=costs.to_json())
    return costs, path, True


@dataclass(frozen=True)
class Choice:
    budget: TreeBudget | None  # None: no head tree
    chain: bool  # the lookup chain joins the verify

    @property
    def vanilla(self) -> bool:
        return self.budget is None and not self.chain


class Controller:
    """The per-request estimates and the per-step choice (pure arithmetic: unit-tested on its own).

    Tree: a decaying ratio of observed to expected accepted tokens scales the table's gains. Chain, per
    n-gram length it matched (a 3-gram match predicts far better than a 1-gram one): the decaying mean
    of its matched tokens (`alone`), and of what it adds beyond the head's tree (`extra` =
    max(0, chain matched - tree matched)), which prices the tree + chain union."""

    def __init__(self, menu: list[tuple[TreeBudget, float]], costs: Costs, scale: float,
                 lookup_prior: dict[int, float] | None = None, decay: float = DECAY,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        self.menu, self.costs, self.decay = menu, costs, decay
        self.gain = dict(menu)
        self.scale_prior, self.weight = scale, prior_weight
        self.num, self.den = prior_weight * scale, prior_weight  # tree: decayed observed / expected tokens
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

    def expected(self, choice: Choice, chain_len: int, room: int, ngram: int = 0) -> tuple[float, float]:
        """(expected tokens, expected seconds) of one step with this choice."""
        c = self.costs
        tree = 0.0
        nodes = 0
        secs = c.lookup_s if chain_len else 0.0
        if choice.budget is not None:
            b = choice.budget
            nodes = min(b.tree_size, room)
            tree = self.scale * self.gain[b] * nodes / b.tree_size
            secs += c.draft_s[b] + c.follow_s
        extra = 0.0
        if choice.chain:
            n = min(chain_len, room - nodes)
            alone, added = self.chain_mean(ngram)
            extra = min(float(n), added if choice.budget is not None else alone)
            nodes += n
        return 1.0 + tree + extra, secs + c.target(1 + nodes)

    def choose(self, chain_len: int, room: int, ngram: int = 0) -> Choice:
        options = [Choice(None, False)]
        if room > 0:
            options += [Choice(b, False) for b, _ in self.menu]
            if chain_len:
                options += [Choice(None, True)] + [Choice(b, True) for b, _ in self.menu]
        rate = {}
        for o in options:
            tokens, secs = self.expected(o, chain_len, room, ngram)
            rate[o] = tokens / secs
        best = max(rate.values())
        # ties (within 0.5%) go to the cheapest option: vanilla first, then smaller trees
        return next(o for o in options if rate[o] >= best * 0.995)

    def step(self) -> None:
        """Every step decays the evidence toward the priors, observed or not."""
        d, w = self.decay, self.weight
        self.num = d * self.num + (1 - d) * w * self.scale_prior
        self.den = d * self.den + (1 - d) * w
        for n, s in self.chain.items():
            p = self.chain_prior[n]
            s[0], s[1], s[2] = d * s[0] + (1 - d) * p, d * s[1] + (1 - d) * p / 2, d * s[2] + (1 - d)

    def observe_tree(self, accepted: int, expected: float) -> None:
        self.num += accepted
        self.den += expected

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
    """How far the emitted tokens follow a path of `tree`: the verifier's own walk. Tree nodes are point
    masses (a rejected child can never be emitted), so this is the accepted length within the tree."""
    return len(greedy_walk(tree, lambda _, k: tokens[k] if k < len(tokens) else None)[0])


@dataclass
class AdaptiveDrafter(Drafter):
    """`auto`'s drafter: an EAGLE head + a prompt-lookup chain, sized (or skipped) every step by the
    Controller. The chain is looked up first (it depends only on emitted tokens), then the choice."""

    eagle: EagleDrafter
    menu: list[tuple[TreeBudget, float]]
    costs: Costs
    lookup: int = 0  # chain tokens (0: no lookup)
    sampled_scale: float = SAMPLED_SCALE
    name: str = "eagle2+pld adaptive"
    choices: Counter = field(default_factory=Counter)  # this request's choices (bench, tests)

    def __post_init__(self) -> None:
        self.pld = PromptLookupDrafter(chain_len=self.lookup) if self.lookup else None
        self.draft_depth = max(b.depth for b, _ in self.menu)
        if not self.lookup:
            self.name = "eagle2 adaptive"
        self.ctrl: Controller | None = None
        self.last: tuple | None = None  # (choice, head tree, its expected tokens, chain, n-gram)

    def begin(self, ctx: DecodeContext) -> None:
        greedy = ctx.params.greedy
        self.ctrl = Controller(self.menu, self.costs, 1.0 if greedy else self.sampled_scale,
                               {n: p if greedy else p / 2 for n, p in LOOKUP_PRIOR.items()})
        self.choices = Counter()
        self.last = None
        self.eagle.begin(ctx)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        chain = self.pld.propose(ctx) if self.pld is not None and ctx.max_nodes > 0 else DraftTree.empty()
        ngram = self.pld.last_ngram if len(chain) else 0
        choice = self.ctrl.choose(len(chain), ctx.max_nodes, ngram)
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
        return tree

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        self.eagle.accept(ctx, verdict)
        if self.last is None:
            return
        choice, eagle_tree, expected, chain, ngram = self.last
        ctrl, new = self.ctrl, verdict.tokens
        ctrl.step()
        t = None
        if eagle_tree is not None and len(eagle_tree):
            t = matched(eagle_tree, new)
            ctrl.observe_tree(t, expected)
        if chain is not None:
            m = float(matched(chain, new))
            if not choice.chain and m == len(new):  # matched all emitted, unverified: at least that many
                m = max(m, ctrl.chain_mean(ngram)[0])
            ctrl.observe_chain(ngram, m, None if t is None else max(0.0, m - t))
        self.last = None
