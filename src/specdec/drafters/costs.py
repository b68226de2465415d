"""The cost model of adaptive speculation: what a step costs on this machine (machine-dependent, unlike
the acceptance model that ships with a head). Measured in ~4 s when the drafter is built (at load) and
cached per CPU, cores, threads, torch, target, precision and head; `recalibrate` re-measures for that
command (and stores it only when no other process was busy). Afterwards the costs follow the machine
online: StepClock compares every verify forward with its price, and between requests the prices are
rescaled per size class, never by stopping a request to run probes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.drafters.base import DecodeContext, begin_on, follow
from specdec.drafters.clock import CatchUp, size_class
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.files import atomic_write_text, cache_dir
from specdec.machine import attention_slope, forward_costs
from specdec.runtime.base import Runner
from specdec.runtime.cpus import ContentionMeter, cpu_name, usable_cpus
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from specdec.verify import Verdict

# forward sizes timed besides 1 + each menu tree's size; others are interpolated. Not assumed monotone:
# measured on an AMD EPYC (SmolLM2, 2 threads), t(2) = 37 ms > t(5) = 32 ms > t(1) = 30 ms
ANCHORS = (1, 2, 3, 5, 9, 13, 17, 25, 33)
# the second context the widest forward is timed at: how fast a row's attention grows with the context
LONG_CTX = 512  # its prefill is most of the ~1 s this adds
VERSION = 5  # of the measurement (2: attention slope, 3: catch-up per row, 4: forwards learned without their
# verification, t(n) of 4 repetitions, 5: a draft model's reading per row); in the cache key: older files re-measure
QUIET = 0.15  # at most this share of the CPUs used by other processes while a stored measurement ran


@dataclass
class Costs:
    """Seconds, measured on this machine: target forwards by row count at a `ctx`-token context, each
    budget's propose() (top-k children; `sampled_s`: children drawn at T > 0), the head's catch-up, one
    lookup, and `attend_s`: what each row of a forward adds per cached token.

    Why the slope: every verified row attends over the whole context, so a tree's price grows with it.
    Measured on an EPYC (SmolLM2, 2 threads): t(9)/t(1) 1.59 at 384 tokens, 2.78 at 2,048; priced at 384,
    long summarization prompts drafted trees that lost 10% to vanilla."""

    target_s: dict[int, float]
    draft_s: dict[TreeBudget, float]
    follow_s: float
    lookup_s: float
    sampled_s: dict[TreeBudget, float] = field(default_factory=dict)
    attend_s: float = 0.0
    ctx: int = 0
    # each row past a typical step's that the head reads before drafting (clock.CatchUp); without a head,
    # each row of context a draft model reads before its chain (adaptive.AdaptiveDrafter.reading_pays)
    catch_row_s: float = 0.0

    def __post_init__(self) -> None:  # here, so that a measurement cached before the floor gets it too
        self.target_s = floor_one_row(self.target_s)

    def target(self, n: int, ctx: int | None = None) -> float:
        """t(n) after `ctx` cached tokens (None: at the measured context): linear between the measured
        sizes (beyond the last, along the last segment, never below the last), plus n rows' attention over the
        extra tokens."""
        dense = self.dense
        t = dense[n] if n < len(dense) else self._rows(n)
        if ctx is None or not self.attend_s:
            return t
        return max(t + n * self.attend_s * (ctx - self.ctx), 0.25 * t)  # the floor: a noisy slope, tiny ctx

    def _rows(self, n: int) -> float:
        if n in self.target_s:
            return self.target_s[n]
        xs = self.sizes
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=xs[-1])
        if hi == lo:
            lo, hi = xs[-2], xs[-1]
        t0, t1 = self.target_s[lo], self.target_s[hi]
        t = t0 + (t1 - t0) * (n - lo) / (hi - lo)
        # past the widest measured size, never below it: a noisy last segment sloping down priced t(33) at
        # 2% of t(1) on a tiny model
        return max(t, self.target_s[xs[-1]]) if n > xs[-1] else t

    def shared(self, n: int) -> Costs:
        """These costs for one of n sequences whose rows share each forward (a batch): a plain step costs its
        share t(n) / n, and each row it adds what that row adds to the forward, t(n + k) - t(n); drafting stays
        whole (each drafts alone). Then a draft pays exactly when it raises the batch's tokens per second.
        Why: on a CPU a row costs nearly as much past a few rows (SmolLM2, 2 cores, packed forwards of four
        sequences: t(4) 9.9 ms, t(8) 11.9, t(16) 18.5), so in a batch of 4 a row costs 20-35% of a sequence's
        step, where alone it cost ~7%."""
        if n <= 1:
            return self
        base = self.target(n)
        return replace(self, target_s={k: base / n + self.target(n + k - 1) - base
                                       for k in range(1, max(self.target_s) + 1)})

    def rescaled(self, factors: list[float], draft: float | None = None) -> Costs:
        """These costs with each forward size's price times its class's factor (SIZE_CLASSES), and the
        drafting costs times `draft` (as observed), or else the one-row factor (the same machine, load)."""
        f1 = factors[0] if draft is None else draft
        return Costs({n: t * factors[size_class(n)] for n, t in self.target_s.items()},
                     {b: t * f1 for b, t in self.draft_s.items()}, self.follow_s * f1, self.lookup_s * f1,
                     {b: t * f1 for b, t in self.sampled_s.items()}, self.attend_s * f1, self.ctx,
                     self.catch_row_s * f1)

    @property
    def sizes(self) -> list[int]:
        return self._tables()[0]

    @property
    def dense(self) -> list[float]:
        """t(n) at the measured context for every n up to the widest measured size, interpolated once:
        target() runs for every option of every step (~30 a step; interpolating each was most of the
        ~60 us a plain step of `auto` spent choosing)."""
        return self._tables()[1]

    def _tables(self) -> tuple[list[int], list[float]]:
        """(sorted sizes, dense t(n)), kept until target_s is replaced."""
        cached = self.__dict__.get("_cached")
        if cached is None or cached[0] is not self.target_s:
            self._cached = (self.target_s, sorted(self.target_s), [])
            self._cached[2].extend([0.0] + [self._rows(n) for n in range(1, self._cached[1][-1] + 1)])
            cached = self._cached
        return cached[1], cached[2]

    def to_json(self) -> dict:
        return {"target_ms": {str(n): round(t * 1e3, 4) for n, t in self.target_s.items()},
                "draft_ms": [[b.depth, b.topk, b.tree_size, round(t * 1e3, 4)] for b, t in self.draft_s.items()],
                "follow_ms": round(self.follow_s * 1e3, 4), "lookup_ms": round(self.lookup_s * 1e3, 4),
                "sampled_draft_ms": [[b.depth, b.topk, b.tree_size, round(t * 1e3, 4)]
                                     for b, t in self.sampled_s.items()],
                "attend_us_per_row_token": round(self.attend_s * 1e6, 6), "ctx": self.ctx,
                "catch_row_ms": round(self.catch_row_s * 1e3, 4)}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        return cls({int(n): t / 1e3 for n, t in d["target_ms"].items()},
                   {TreeBudget(a, b, c): t / 1e3 for a, b, c, t in d["draft_ms"]}, d["follow_ms"] / 1e3,
                   d["lookup_ms"] / 1e3, {TreeBudget(a, b, c): t / 1e3 for a, b, c, t in d.get("sampled_draft_ms", [])},
                   d.get("attend_us_per_row_token", 0.0) / 1e6, d.get("ctx", 0), d.get("catch_row_ms", 0.0) / 1e3)


def cost_key(runner: Runner, head_dir: str | None, menu: list[tuple[TreeBudget, float]], lookup: int,
             sampled: list[tuple[TreeBudget, float]] = ()) -> dict:
    cfg = runner.config
    return {"version": VERSION, "cpu": cpu_name(), "usable_cpus": usable_cpus(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "target": str(getattr(cfg, "_name_or_path", "")),
            "target_shape": [getattr(cfg, "hidden_size", 0), getattr(cfg, "num_hidden_layers", 0),
                             runner.vocab_size],
            "dtype": str(runner.dtype), "weights": runner.weights, "device": str(runner.device),
            "kernel": runner.decode_kernel, "kernel_build": runner.kernel_build,
            "head": Path(head_dir).name if head_dir else "",
            "menu": [list(b.__dict__.values()) for b, _ in menu],
            "lookup": lookup, **({"sampled": [list(b.__dict__.values()) for b, _ in sampled]} if sampled else {})}


@torch.inference_mode()
def measure_costs(runner, drafter: EagleDrafter, menu: list[tuple[TreeBudget, float]], lookup: int,
                  reps: int = 3, ctx_len: int = 384, sampled: list[tuple[TreeBudget, float]] = ()) -> Costs:
    """~4 s for SmolLM2-135M on 2 cores: t(N) for every menu tree and at the anchors up to the largest
    tree + chain, then each budget's propose() (the `sampled` menu's with children drawn at T = 1, which
    needs a drafter with children="sample") and the head's catch-up as decoding leaves the caches, at a
    ctx_len-token context; the widest forward over LONG_CTX more tokens gives the attention slope."""
    top = max(b.tree_size for b, _ in menu) + lookup + 1
    target_s, attend_s = target_costs(runner, top, {1 + b.tree_size for b, _ in [*menu, *sampled]}, ctx_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(runner.vocab_size, 1000), (ctx_len + 48,), generator=g).tolist()
    ctx, out = begin_on(runner, drafter, ids, ctx_len)
    feats, aux = out.features, out.aux
    draft_s = {b: _time_warm(lambda: drafter.propose(ctx, b), reps) for b, _ in menu}
    hot = DecodeContext(ctx.tokens, SamplingParams(1.0), torch.Generator().manual_seed(0), ctx_len, ctx.features,
                        aux_features=ctx.aux_features)
    sampled_s = {b: _time_warm(lambda: drafter.propose(hot, b), reps) for b, _ in sampled}
    # follow_s: what a drafted step costs beyond its tree's warm propose(): the head reading the step's
    # rows, and the head's weights back in the caches after the target forward evicted them (a
    # back-to-back probe missed that: 0.85 ms of a 2.7 ms step, SmolLM2 head on an EPYC)
    b0 = menu[0][0]
    catch_up = []
    for i in range(reps):  # a typical step: one accepted token + the bonus
        new = ids[ctx_len + 1 + 2 * i:ctx_len + 3 + 2 * i]
        follow(drafter, ctx, new, feats[ctx_len + 2 * i:ctx_len + 2 + 2 * i],
               None if aux is None else aux[ctx_len + 2 * i:ctx_len + 2 + 2 * i], Verdict([0], new, new[-1]))
        runner.forward(torch.tensor(ids[:1]), logits_rows=slice(-1, None))  # as before every draft
        runner.reset()
        t = time.perf_counter()
        drafter.propose(ctx, b0)  # reads the new rows first
        catch_up.append(time.perf_counter() - t - draft_s[b0])
    # a draft after plain steps: the head first reads CatchUp.PRICED_ROWS more rows (steps of 2 rows)
    follow_s, wide = max(0.0, min(catch_up)), []
    at = ctx_len + 2 * reps
    for _ in range(reps):
        for j in range(at, at + CatchUp.TYPICAL_ROWS + CatchUp.PRICED_ROWS, 2):
            new = ids[j + 1:j + 3]
            follow(drafter, ctx, new, feats[j:j + 2], None if aux is None else aux[j:j + 2], Verdict([0], new, new[-1]))
        at += CatchUp.TYPICAL_ROWS + CatchUp.PRICED_ROWS
        runner.forward(torch.tensor(ids[:1]), logits_rows=slice(-1, None))
        runner.reset()
        t = time.perf_counter()
        drafter.propose(ctx, b0)
        wide.append(time.perf_counter() - t - draft_s[b0])
    catch_row_s = max(0.0, min(wide) - follow_s) / CatchUp.PRICED_ROWS
    pld = PromptLookupDrafter(chain_len=max(lookup, 1))
    look = _time_warm(lambda: pld.propose(ctx), reps)
    drafter.runner.reset()  # every request begins afresh anyway
    return Costs(target_s, draft_s, follow_s, look, sampled_s, attend_s, ctx_len, catch_row_s)


def target_costs(runner, top: int, sizes: set[int], ctx_len: int) -> tuple[dict[int, float], float]:
    """t(N) at `sizes`, at the anchors below `top` and at `top` rows after ctx_len cached tokens, and the
    attention slope: `top` rows timed over LONG_CTX more tokens."""
    sizes = sorted({n for n in ANCHORS if n < top} | sizes | {top})
    # min: the least disturbed repetition; of 4, as of 2 the ratios t(n) / t(1) moved ~15% between measurements
    target_s = forward_costs(runner, sizes, 4, ctx=ctx_len, stat=min, warmup=1)
    extra = min(LONG_CTX, runner.max_length - ctx_len - top)  # a small model's context may be short
    return target_s, attention_slope(runner, top, ctx_len, extra) if extra >= 64 else 0.0


@torch.inference_mode()
def measure_plain_costs(runner, ngram: NgramDrafter | None, draft: DraftModelDrafter | None,
                        menu: list[tuple[TreeBudget, float]], reps: int = 3, ctx_len: int = 384) -> Costs:
    """Costs of `auto` without a head: t(N) up to the n-gram draft's nodes + the longest draft-model chain
    in `menu` + 1, one n-gram propose() on text that repeats (its dearest case), and each menu chain's
    draft-model propose() as a step that follows the last one drafts it (no catch-up of skipped tokens), and
    what the draft model's reading of the context costs per row (its first propose() on an empty cache)."""
    top = 1 + (ngram.tree_size if ngram is not None else 0) + max((b.tree_size for b, _ in menu), default=0)
    target_s, attend_s = target_costs(runner, top, {1 + b.tree_size for b, _ in menu}, ctx_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(runner.vocab_size, 1000), (64,), generator=g).tolist() * (ctx_len // 64 + 2)
    ctx = DecodeContext(ids[:ctx_len + 1], SamplingParams(), None, ctx_len)
    look = 0.0
    if ngram is not None:
        ngram.begin(ctx)
        look = _time_warm(lambda: ngram.propose(ctx), reps)
    draft_s, read_s = {}, 0.0
    if draft is not None:
        draft.begin(ctx)
        draft_s = {b: _time_warm(lambda: draft.propose(ctx, b), reps) for b, _ in menu}
        first = menu[0][0]

        def read() -> None:
            draft.begin(ctx)  # an empty cache: the chain reads the whole context first
            draft.propose(ctx, first)
        read_s = max(_time_warm(read, 1) - draft_s[first], 0.0) / (ctx_len + 1)
        draft.runner.reset()
    runner.reset()
    return Costs(target_s, draft_s, 0.0, look, {}, attend_s, ctx_len, read_s)


def load_plain_costs(runner, ngram: NgramDrafter | None, draft: DraftModelDrafter | None,
                     menu: list[tuple[TreeBudget, float]], recalibrate: bool = False) -> tuple[Costs, Path, str]:
    """load_costs for `auto` without a head."""
    dcfg = draft.runner.config if draft is not None else None
    key = {**cost_key(runner, None, menu, ngram.tree_size if ngram is not None else 0), "drafter": "ngram",
           "draft": None if draft is None else [str(getattr(dcfg, "_name_or_path", "")),
                                                getattr(dcfg, "hidden_size", 0), getattr(dcfg, "num_hidden_layers", 0),
                                                str(draft.runner.dtype), draft.runner.weights,
                                                draft.runner.requantized_to,
                                                draft.runner.vocab_size]}
    return cached_costs(key, lambda: measure_plain_costs(runner, ngram, draft, menu), recalibrate)


def floor_one_row(target_s: dict[int, float]) -> dict[int, float]:
    """t(1) no dearer than any wider forward: a one-row forward never does more work, and under another
    process's load a disturbed t(1) (measured 44 ms beside t(2) = 32 ms) priced every draft as nearly free.
    Wider sizes are left as measured (t(2) > t(5) is real on some oneDNN paths)."""
    return {**target_s, 1: min(target_s.values())} if 1 in target_s else target_s


def _time_warm(fn, reps: int) -> float:
    """The least disturbed of reps timings of fn, after one untimed call."""
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts[1:])


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


def store_learned(path: Path, costs: Costs) -> None:
    """Prices learned online replace the cached ones in their key's file: the next process starts from
    what this machine does now, not from a measurement that went stale (its first request would pay)."""
    rec = json.loads(path.read_text())
    write_cost_file(path, rec["key"], costs=costs.to_json(), learned_online=True)


def write_cost_file(path: Path, key: dict, **fields) -> None:
    atomic_write_text(path, json.dumps({"key": key, **fields, "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                       indent=1) + "\n")


def load_costs(runner, drafter: EagleDrafter, head_dir: str | None, menu: list[tuple[TreeBudget, float]],
               lookup: int, recalibrate: bool = False,
               sampled: list[tuple[TreeBudget, float]] = ()) -> tuple[Costs, Path, str]:
    """(costs, cache file, origin): this machine's cached measurement for exactly this key ("cached"), else
    a new one (written atomically; origin "measured at load in 3.1 s")."""
    key = {**cost_key(runner, head_dir, menu, lookup, sampled), "head_weights": drafter.runner.weights}
    return cached_costs(key, lambda: measure_costs(runner, drafter, menu, lookup, sampled=sampled), recalibrate)


def cached_costs(key: dict, measure: Callable[[], Costs], recalibrate: bool = False) -> tuple[Costs, Path, str]:
    """A re-measure asked for (`recalibrate`) serves its own command; it replaces the stored costs only if
    no other process was busy meanwhile (one taken under load would misprice every later process).
    origin: "cached", or how long the measurement took (at load, before any request)."""
    path = cost_file(key)
    rec = read_cost_file(path, key)
    stored = None
    if rec is not None:
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a damaged entry is measured again
            stored = Costs.from_json(rec["costs"])
    if stored is not None and not recalibrate:
        return stored, path, "cached"
    meter = ContentionMeter()
    t0 = time.perf_counter()
    costs = measure()
    origin = f"measured at load in {time.perf_counter() - t0:.1f} s"
    busy = meter.result().get("other_cpu_frac")
    if stored is None or busy is None or busy <= QUIET:
        write_cost_file(path, key, costs=costs.to_json())
    else:
        origin += f" (not stored: other processes used {busy:.0%} of the CPUs)"
    return costs, path, origin


