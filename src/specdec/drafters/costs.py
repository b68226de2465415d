"""What a step of `auto` costs on this machine (unlike acceptance, which ships with a head): measured in a
few seconds when the drafter is built and cached per CPU, cores, threads, torch, target and drafters
(`recalibrate` re-measures; a measurement taken while other processes were busy is not stored), then
rescaled between requests to what the steps took (clock.StepClock)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.drafters.base import DecodeContext, Drafter, TreeDrafter, follow
from specdec.drafters.clock import PRICED_ROWS, TYPICAL_ROWS, size_class
from specdec.machine import attention_slope, cached, forward_costs, machine_key, runner_identity
from specdec.runtime.base import Runner
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from specdec.verify import Verdict

# forward sizes timed besides 1 + each draft's size; others are interpolated. Not assumed monotone:
# measured on an AMD EPYC (SmolLM2, 2 threads), t(2) = 37 ms > t(5) = 32 ms > t(1) = 30 ms
ANCHORS = (1, 2, 3, 5, 9, 13, 17, 25, 33)
LONG_CTX = 512  # the widest forward is timed again this many tokens later: the attention slope
VERSION = 6  # of the measurement; in the cache key, so older files re-measure


@dataclass
class Costs:
    """Seconds: target forwards by rows at a `ctx`-token context, each draft budget's propose() (top-k
    children; `sampled_s`: drawn at T > 0), a head's reading of a drafted step's rows (follow_s), one
    n-gram lookup, each row's attention per cached token (attend_s: measured on an EPYC, t(9)/t(1) was
    1.59 at 384 tokens and 2.78 at 2,048), and per row the model drafter has not read (catch_row_s: a
    head's rows of skipped steps, a draft model's prompt)."""

    target_s: dict[int, float]
    draft_s: dict[TreeBudget, float] = field(default_factory=dict)
    follow_s: float = 0.0
    lookup_s: float = 0.0
    sampled_s: dict[TreeBudget, float] = field(default_factory=dict)
    attend_s: float = 0.0
    ctx: int = 0
    catch_row_s: float = 0.0

    def __post_init__(self) -> None:
        # t(1) no dearer than a wider forward: a disturbed t(1) (44 ms beside t(2) = 32) priced drafts as free;
        # wider sizes stay as measured (t(2) > t(5) is real on some oneDNN paths)
        if 1 in self.target_s:
            self.target_s = {**self.target_s, 1: min(self.target_s.values())}

    def target(self, n: int, ctx: int | None = None) -> float:
        """t(n) after `ctx` cached tokens (None: at the measured context): linear between measured sizes, past
        the widest along the last segment but never below it (a noisy last segment once priced t(33) at 2% of
        t(1)), plus n rows' attention over the extra tokens (priced at 384 tokens, long summarization prompts
        drafted trees that lost 10% to vanilla)."""
        ts, xs = self.target_s, sorted(self.target_s)
        if n in ts:
            t = ts[n]
        else:
            lo, hi = max([x for x in xs if x < n], default=xs[0]), min([x for x in xs if x > n], default=xs[-1])
            if hi == lo:
                lo, hi = xs[-2], xs[-1]
            t = ts[lo] + (ts[hi] - ts[lo]) * (n - lo) / (hi - lo)
            t = max(t, ts[xs[-1]]) if n > xs[-1] else t
        if ctx is None or not self.attend_s:
            return t
        return max(t + n * self.attend_s * (ctx - self.ctx), 0.25 * t)  # the floor: a noisy slope, tiny ctx

    def shared(self, n: int) -> Costs:
        """For one of n sequences sharing each forward (a batch): a plain step costs t(n) / n, each added row
        t(n + k) - t(n), drafting stays whole; so a draft pays exactly when it raises the batch's tokens per
        second (SmolLM2, 2 cores: t(4) 9.9 ms, t(8) 11.9: in a batch of 4 a row costs 20-35% of a step)."""
        if n <= 1:
            return self
        base = self.target(n)
        return replace(self, target_s={k: base / n + self.target(n + k - 1) - base
                                       for k in range(1, max(self.target_s) + 1)})

    def rescaled(self, factors: list[float], draft: float | None = None) -> Costs:
        """Each forward size's price times its class's factor (clock.SIZE_CLASSES); drafting times `draft`
        (as observed), or else the one-row factor (the same machine, the same load)."""
        f = factors[0] if draft is None else draft
        return Costs({n: t * factors[size_class(n)] for n, t in self.target_s.items()},
                     {b: t * f for b, t in self.draft_s.items()}, self.follow_s * f, self.lookup_s * f,
                     {b: t * f for b, t in self.sampled_s.items()}, self.attend_s * f, self.ctx, self.catch_row_s * f)

    def to_json(self) -> dict:
        return {**{k: [[*b.__dict__.values(), t] for b, t in getattr(self, k).items()] for k in BUDGETS},
                "target_s": {str(n): t for n, t in self.target_s.items()}, **{k: getattr(self, k) for k in SCALARS}}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        return cls({int(n): t for n, t in d["target_s"].items()},
                   **{k: {TreeBudget(*r[:3]): r[3] for r in d[k]} for k in BUDGETS}, **{k: d[k] for k in SCALARS})


BUDGETS, SCALARS = ("draft_s", "sampled_s"), ("follow_s", "lookup_s", "attend_s", "ctx", "catch_row_s")


def _time_warm(fn, reps: int) -> float:
    """The least disturbed of reps timings of fn, after one untimed call."""
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts[1:])


@torch.inference_mode()
def measure_costs(runner: Runner, model: TreeDrafter | None, menu: list[tuple[TreeBudget, float]],
                  ngram: Drafter | None, sampled: list[tuple[TreeBudget, float]] = (), reps: int = 3,
                  ctx_len: int = 384) -> Costs:
    """At a ctx_len-token context of text that repeats (an n-gram lookup's dearest case; 8.6 s for SmolLM2
    and its head on a 2-GHz Zen 1): t(N) at the anchors and 1 + each draft's size, the attention slope,
    each budget's propose() (the `sampled` menu's at T = 1), one n-gram propose(), and what the model pays
    for rows it has not read: a head's follow of a drafted step and per row past it, each timed after a
    target forward evicted its weights (back to back, a probe missed 0.85 ms of a 2.7 ms step); a draft
    model's reading of the prompt per row."""
    sizes = [b.tree_size for b, _ in [*menu, *sampled]]
    top = 1 + max(sizes, default=0) + (ngram.tree_size if ngram is not None else 0)
    sizes = sorted({n for n in ANCHORS if n < top} | {1 + s for s in sizes} | {top})
    # min: the least disturbed repetition; of 4, as of 2 the ratios t(n) / t(1) moved ~15% between measurements
    target_s = forward_costs(runner, sizes, 4, ctx=ctx_len, stat=min, warmup=1)
    extra = min(LONG_CTX, runner.max_length - ctx_len - top)  # a small model's context may be short
    # the slope over 9 rows at most: the attention it times grows with the rows as the forward does
    attend_s = attention_slope(runner, min(top, 9), ctx_len, extra) if extra >= 64 else 0.0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(runner.vocab_size, 1000), (64,), generator=g).tolist() * (ctx_len // 64 + 2)
    costs = Costs(target_s, attend_s=attend_s, ctx=ctx_len)
    head = model is not None and model.reads_features
    feats = aux = None
    if head:  # the features of the first 64 tokens, repeated as the text repeats: the timings do not depend on them
        runner.reset()
        out = runner.forward(torch.tensor(ids[:64]), logits_rows=slice(-1, None), aux_layers=model.aux_layers)
        feats = out.features.repeat(len(ids) // 64, 1)
        aux = None if out.aux is None else out.aux.repeat(len(ids) // 64, 1)
    runner.reset()
    ctx = DecodeContext(ids[:ctx_len + 1], SamplingParams(), None, ctx_len, None if feats is None else
                        feats[:ctx_len], aux_features=None if aux is None else aux[:ctx_len])
    if ngram is not None:
        ngram.begin(ctx)
        costs.lookup_s = _time_warm(lambda: ngram.propose(ctx), reps)
    if model is None:
        return costs
    model.begin(ctx)
    b0 = menu[0][0]
    costs.draft_s = {b: _time_warm(lambda: model.propose(ctx, b), reps) for b, _ in menu}
    hot = replace(ctx, params=SamplingParams(1.0), generator=torch.Generator().manual_seed(0))
    costs.sampled_s = {b: _time_warm(lambda: model.propose(hot, b), reps) for b, _ in sampled}
    if not head:  # timed once: warm already, and reading the whole context is long
        t = time.perf_counter()
        model.begin(ctx)
        model.propose(ctx, b0)
        costs.catch_row_s = max(time.perf_counter() - t - costs.draft_s[b0], 0.0) / (ctx_len + 1)
    else:
        at = ctx_len

        def after(rows: int) -> float:
            """propose() after the head followed `rows` rows (in steps of 2), beyond its warm time."""
            nonlocal at
            ts = []
            for _ in range(reps):
                for j in range(at, at + rows, 2):
                    new = ids[j + 1:j + 3]
                    follow(model, ctx, new, feats[j:j + 2], None if aux is None else aux[j:j + 2],
                           Verdict([0], new, new[-1]))
                at += rows
                runner.forward(torch.tensor(ids[:1]), logits_rows=slice(-1, None))  # as before every draft
                runner.reset()
                t = time.perf_counter()
                model.propose(ctx, b0)
                ts.append(time.perf_counter() - t - costs.draft_s[b0])
            return max(0.0, min(ts))

        costs.follow_s = after(TYPICAL_ROWS)
        costs.catch_row_s = max(0.0, after(TYPICAL_ROWS + PRICED_ROWS) - costs.follow_s) / PRICED_ROWS
    model.runner.reset()  # every request begins afresh anyway
    runner.reset()
    return costs


def load_costs(runner: Runner, model: TreeDrafter | None, menu: list[tuple[TreeBudget, float]], ngram: Drafter | None,
               head: str | None = None, recalibrate: bool = False,
               sampled: list[tuple[TreeBudget, float]] = ()) -> tuple[Costs, Path, str]:
    """cached(): the costs of `auto` with these drafters (head: the directory of the head `model` is)."""
    key = {**machine_key(runner), "version": VERSION,
           "model": [Path(head).name, model.runner.weights] if head else model and runner_identity(model.runner),
           "menu": [list(b.__dict__.values()) for b, _ in [*menu, *sampled]], "sampled": len(sampled),
           "ngram": None if ngram is None else [type(ngram).__name__, ngram.tree_size]}
    return cached(key, lambda: measure_costs(runner, model, menu, ngram, sampled).to_json(), Costs.from_json,
                  recalibrate)
