"""Adaptive speculation (`auto`): the policy's choice and its estimates, the cost cache, and losslessness
with the draft size changing from step to step (greedy equality, chi-square at T > 0 with top-k / top-p)."""

import bisect
import itertools
import json
import math
import random
import shutil

import pytest
import torch

from specdec.drafters.adaptive import SAMPLED_SCALE, AdaptiveDrafter, NgramDraft, matched
from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.clock import SIZE_CLASSES, StepClock, size_class
from specdec.drafters.costs import Costs, load_costs
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.policy import (
    BUCKET,
    EDGES,
    HURDLE,
    TIE,
    VANILLA,
    Beyond,
    Calibration,
    Choice,
    Policy,
    TreeScale,
    menu_from_tuning,
    prefixes,
)
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeBudget
from specdec.tuning import load_tuning, save_tuning
from specdec.verify import Verdict, greedy_walk
from tests.helpers import (
    PROMPTS,
    SMALL_V,
    chi2_pvalue,
    drafter_for,
    exact_first3,
    flat_tiny,
    make_head,
    run,
    sample_first3,
    tiny_model,
)

B4, B8 = TreeBudget(2, 2, 4), TreeBudget(3, 3, 8)
MENU = [(B4, 0.9), (B8, 1.3)]


def costs(slope: float, draft: float = 0.05) -> Costs:
    """t(N) = 1 + slope * (N - 1) seconds (a unit forward), drafts `draft` each."""
    return Costs({n: 1 + slope * (n - 1) for n in (1, 2, 5, 9, 17, 33)}, {B4: draft, B8: 2 * draft}, 0.01, 0.001)


def head_policy(c: Costs, menu=MENU, **kw) -> Policy:
    """The policy `auto` prices a head's options by (a draft must beat a plain step by the hurdle)."""
    return Policy(menu, c, hurdle=HURDLE, **kw)


def chain_after(ngram: int, length: int) -> NgramDraft:
    """The lookup chain `auto` drafts beside a head after an n-gram match of this length: `length` tokens
    copied from the match's latest occurrence, each node's raw confidence from the match."""
    seen = list(range(100, 100 + ngram))
    ctx = DecodeContext(seen + list(range(length)) + [99] + seen, SamplingParams(), None, 1)
    d = AdaptiveDrafter(costs(0.1), ngram=PromptLookupDrafter(chain_len=length))
    d.begin(ctx)
    d.propose(ctx)
    draft = d.pending[-1]  # the step's n-gram draft, as the policy priced it
    assert draft.tokens == list(range(length)) and d.ngram.last_ngram == ngram
    return draft


def priced(cal: Calibration, draft: NgramDraft) -> list[float]:
    return cal.gains(draft.confs, draft.parents)


# ---- the policy ----

def test_a_disturbed_one_row_forward_is_floored_by_the_wider_ones():
    assert Costs({1: 44.0, 2: 32.0, 5: 39.0}).target_s == {1: 32.0, 2: 32.0, 5: 39.0}
    assert Costs({1: 30.0, 2: 37.0, 5: 32.0}).target_s == {1: 30.0, 2: 37.0, 5: 32.0}  # wider sizes untouched
    cached = Costs({1: 44.0, 2: 32.0, 5: 39.0}, {}, 0.0, 0.0).to_json()  # as an older cache file holds it
    assert Costs.from_json(cached | {"target_s": {"1": 44.0, "2": 32.0, "5": 39.0}}).target(1) == pytest.approx(32.0)


def test_a_row_shared_by_a_batch_costs_its_share_of_the_forward_and_drafts_pay_less():
    """In a batch of n a plain step costs t(n) / n and each added row t(n + k) - t(n): a chain whose tokens
    pay alone (one row ~10% of a step) does not pay in a batch of 4, where a row is ~40% of a sequence's step;
    the sure chain pays in both. Prices go back when the batch shrinks to one."""
    c = costs(0.1)
    assert c.shared(1) is c
    s = c.shared(4)
    assert s.target(1) == pytest.approx(c.target(4) / 4)
    for k in (2, 5, 9):
        assert s.target(k) - s.target(1) == pytest.approx(c.target(4 + k - 1) - c.target(4))
    assert s.draft_s == c.draft_s and s.follow_s == c.follow_s and s.attend_s == c.attend_s

    weak, sure = [0.3, 0.6, 0.9, 1.2], [0.95, 1.9, 2.85, 3.8]  # expected accepted tokens of each prefix
    p = head_policy(c, [])
    assert p.choose(weak, 100).chain > 0  # alone: 1.3 tokens a step for t(2) = 1.1
    p.reprice(c.shared(4))
    assert p.choose(weak, 100).vanilla  # shared by 4: a row adds 0.1 to a 0.325 share
    assert head_policy(c.shared(4), []).choose(sure, 100).chain > 0
    p.reprice(c)
    assert p.choose(weak, 100).chain > 0


def test_costs_interpolate_between_and_beyond_measured_sizes():
    c = Costs({1: 1.0, 5: 2.0, 9: 4.0}, {}, 0.0, 0.0)
    assert c.target(1) == 1.0 and c.target(3) == pytest.approx(1.5) and c.target(7) == pytest.approx(3.0)
    assert c.target(13) == pytest.approx(6.0)  # along the last segment
    assert Costs({1: 1.0, 5: 2.0, 9: 1.5}, {}, 0.0, 0.0).target(33) == pytest.approx(1.5)  # never below the last
    c.target_s = {1: 2.0, 5: 4.0, 9: 8.0}  # new prices (as tests and rescaling set them): no stale table
    assert c.target(3) == pytest.approx(3.0) and c.target(13) == pytest.approx(12.0)


def options(p: Policy, gains: list[float], room: int, scale: float, beyond: float) -> list[Choice]:
    """Every option of a step, cheapest first: vanilla, each menu draft, then per n-gram prefix the prefix
    alone and its union with each menu draft where the n-gram part adds expected tokens to the draft's."""
    out = [VANILLA]
    if room <= 0:
        return out
    out += [Choice(b, 0) for b in p.gain]
    for m in prefixes(len(gains), room):
        out.append(Choice(None, m))
        for b, g in p.gain.items() if p.union else ():
            nodes = min(b.tree_size, room)
            n, tree = min(m, room - nodes), scale * g * nodes / b.tree_size
            if n > 0 and max(0.0, gains[n - 1] - tree, beyond * gains[n - 1]) > 0:
                out.append(Choice(b, m))
    return out


def reference_choice(p: Policy, gains, room, ctx=None, scale=1.0, catch_up=0.0, beyond=0.0, look=0.0) -> Choice:
    """The choice spelled out: every option priced by `expected`, the best rate (vanilla's raised by the
    hurdle), ties within TIE to the cheapest option."""
    opts = options(p, gains, room, scale, beyond)
    rates = []
    for o in opts:
        tokens, secs = p.expected(o, gains, room, ctx, scale, catch_up, beyond, look)
        rates.append(tokens / secs * (1 + p.hurdle if o.vanilla else 1))
    best = max(rates)
    return next(o for o, r in zip(opts, rates) if r >= best * TIE)


RANDOM_MENU = [(TreeBudget(2, 2, 4), 0.9), (TreeBudget(3, 3, 8), 1.3), (TreeBudget(4, 4, 16), 1.6)]


def random_costs(u: list[float], attend: float) -> Costs:
    """Costs from uniforms u[0..4]: t(n)'s slope, the drafts, follow, lookup and the attention slope. t(n)
    rises with the rows at every context the tests price (the bounds' premise): its slope, at least 0.03 a
    row, outweighs what attention takes off a row below the measured context (at most attend * 300)."""
    return Costs({n: 1 + (0.03 + 0.3 * u[0]) * (n - 1) for n in (1, 2, 5, 9, 17, 33)},
                 {b: 0.3 * u[1] * b.tree_size / 4 for b, _ in RANDOM_MENU}, 0.05 * u[2], 0.01 * u[3],
                 attend_s=attend * u[4], ctx=300)


def random_draft(rng: random.Random) -> tuple[list[float], list[int]]:
    """An n-gram draft's raw confidences and parents: a chain (prompt lookup) or a tree, best first."""
    n = rng.randrange(1, 20)
    confs = sorted((rng.random() for _ in range(n)), reverse=True)
    if rng.random() < 0.5:
        return confs, list(range(-1, n - 1))
    return confs, [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def test_a_plain_step_below_the_tree_bar_is_the_choice_pricing_every_tree_makes():
    """Without an n-gram draft, a tree scale under the bar of the context's bucket (no menu draft beats a
    plain step below it) skips pricing the drafts: the choice is still the one every option priced gives,
    on both sides of the bar and at every context."""
    g = torch.Generator().manual_seed(1)
    below = drafted = 0
    for i in range(300):
        u = torch.rand(8, generator=g).tolist()
        p = Policy(RANDOM_MENU, random_costs(u, 1e-4), hurdle=HURDLE if i % 2 else 0.0)
        ctx = int(3000 * u[5])
        bars, _, _ = p.plain_bounds(ctx, 0.0)
        bar = min(k / g for k, (_, g) in zip(bars, RANDOM_MENU))
        scale = bar * (0.8 + 0.4 * u[6])  # within 20% of the bar, either side
        catch_up = 0.1 * u[7]
        got = p.choose([], 100, ctx, scale, catch_up)
        assert got == reference_choice(p, [], 100, ctx, scale, catch_up), (i, u)
        below += scale < bar
        drafted += not got.vanilla
    assert below > 100 and drafted > 30


def test_a_heads_catch_up_rules_its_trees_out_without_pricing_them():
    """Every menu draft pays the head's catch-up first: a catch-up past the last tree's break-even (its bound
    K_i + P * c) makes the step plain without pricing a tree; just under it the trees are priced. Either
    way the choice is the one pricing every option gives."""
    g = torch.Generator().manual_seed(3)
    tried = 0
    for i in range(200):
        u = torch.rand(8, generator=g).tolist()
        p = Policy(RANDOM_MENU, random_costs(u, 1e-4), hurdle=HURDLE if i % 2 else 0.0)
        calls = []
        times = p.times
        p.times = lambda *a, times=times, calls=calls: calls.append(1) or times(*a)
        ctx, scale = 300 + int(3000 * u[5]), 2.0 * u[6]
        bars, _, plain = p.plain_bounds(ctx, 0.0)
        edge = max((scale * gi - k) / plain for k, (_, gi) in zip(bars, RANDOM_MENU))
        if edge <= 0:
            continue
        tried += 1
        for catch_up, prices in ((edge * 1.001, False), (edge * 0.999, True)):
            calls.clear()
            got = p.choose([], 100, ctx, scale, catch_up)
            assert bool(calls) == prices and got == reference_choice(p, [], 100, ctx, scale, catch_up), (i, u)
            assert prices or got.vanilla
    assert tried > 50


def test_the_step_choice_is_the_best_priced_option_over_random_states():
    """choose() equals pricing every option by expected() (vanilla with the hurdle, each menu draft, each
    n-gram prefix alone and in union with each draft) over random costs, tree scales, n-gram drafts priced by
    a calibration with a random history, unions' shares, catch-ups and rooms: where the bounds of the
    context's bucket prune (a context given and room for the widest draft) and where every option is priced."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    pruned = ruled_out = partly = whole = differ = unions = 0
    for i in range(1200):
        u = torch.rand(8, generator=g).tolist()
        # text that drafts little, text in between, text both drafts follow (cheap rows and drafts, a chain
        # whose matches come beyond the trees')
        kind = rng.randrange(3)
        if kind == 2:
            u[0], u[1] = 0.2 * u[0], 0.2 * u[1]
        c = random_costs(u, 1e-4)
        p = Policy(RANDOM_MENU, c, union=u[5] < 0.7, hurdle=rng.choice([0.0, HURDLE]))
        cal, beyond = Calibration(), Beyond()
        for _ in range(rng.randrange(0, 30)):
            cal.step()
            cal.observe(rng.random(), rng.random() < u[6])
            beyond.observe(rng.randrange(0, 8), rng.randrange(0, 8) if kind < 2 else 0)
        confs, parents = random_draft(rng) if rng.random() < 0.75 else ([], [])
        gains = cal.gains([x * (0.3 if kind == 0 else 1.0) for x in confs], parents)
        look = c.lookup_s if gains else 0.0
        room, ctx = rng.choice([0, 3, 7, 16, 100]), rng.choice([None, 50, 300, 2000])
        scale, catch_up = (0.5, 1.7, 2.0)[kind] * u[7], rng.choice([0.0, 0.1 * rng.random()])
        got = p.choose(gains, room, ctx, scale, catch_up, beyond.share, look)
        assert got == reference_choice(p, gains, room, ctx, scale, catch_up, beyond.share, look), (i, u)
        if ctx is not None and room >= p.widest:
            pruned += 1
            bars, least, _ = p.plain_bounds(ctx, look)
            top = gains[min(len(gains), room) - 1] if gains else 0.0
            out = sum(scale * g + top < k for k, (_, g) in zip(bars, RANDOM_MENU)) + (top < least)
            ruled_out += out == len(bars) + 1
            partly += 0 < out <= len(bars) and not got.vanilla
        else:
            whole += 1
        differ += not got.vanilla
        unions += got.budget is not None and got.chain > 0
    # both paths, with steps whose options were all ruled out and drafting ones with some ruled out
    assert pruned > 300 and whole > 600 and ruled_out > 50 and partly > 80
    assert differ > 500 and unions > 30


def test_a_step_whose_options_the_bounds_rule_out_prices_none_of_them():
    """The bounds are the break-even of an option priced at its bucket's first context against a plain step
    priced at its last, and a step uses them: just under them (the tree scale under the bar; beside an n-gram
    draft, the draft under its own bound and the scale under what is left of each draft's) it is a plain step
    that prices no option; just over them it prices its options."""
    g = torch.Generator().manual_seed(2)
    both = 0
    for i in range(100):
        u = torch.rand(8, generator=g).tolist()
        c = random_costs(u, 1e-4)
        p = Policy(RANDOM_MENU, c, hurdle=HURDLE if i % 2 else 0.0)
        calls = []
        times = p.times
        p.times = lambda *a, times=times, calls=calls: calls.append(1) or times(*a)
        ctx, look = 300 + int(3000 * u[5]), c.lookup_s
        first, last = ctx - ctx % BUCKET, ctx - ctx % BUCKET + BUCKET - 1
        cases = []
        for cost in (0.0, look):
            plain = (1 + p.hurdle) / (cost + c.target(1, last))
            bars = [plain * (cost + c.draft_s[b] + c.follow_s + c.target(1 + b.tree_size, first)) - 1
                    for b, _ in RANDOM_MENU]
            least = plain * (cost + c.target(2, first)) - 1
            assert p.plain_bounds(ctx, cost)[:2] == (pytest.approx(bars), pytest.approx(least))
        bars, least, _ = p.plain_bounds(ctx, 0.0)
        bar = min(k / g for k, (_, g) in zip(bars, RANDOM_MENU))
        assert least > 0 and bar > 0
        cases += [([], bar * 0.999, 0.0, False), ([], bar * 1.001, 0.0, True)]
        bars, least, _ = p.plain_bounds(ctx, look)
        top = least * 0.999
        room = min((k - top) / g for k, (_, g) in zip(bars, RANDOM_MENU))  # the scale left under every bound
        if room > 0:
            both += 1
            cases += [([top], room * 0.999, look, False), ([least * 1.001], room * 0.999, look, True),
                      ([top], room * 1.001, look, True)]
        for gains, scale, cost, prices in cases:
            calls.clear()
            got = p.choose(gains, 100, ctx, scale, 0.0, 0.5, cost)
            assert bool(calls) == prices, (i, gains, scale)
            assert got == reference_choice(p, gains, 100, ctx, scale, 0.0, 0.5, cost)
            assert prices or got.vanilla
    assert both > 50


def test_a_draft_just_beyond_the_ties_with_a_plain_step_is_never_ruled_out():
    """The bounds hold over the whole bucket of contexts: a menu draft, or an n-gram draft alone, priced just
    beyond the ties' band of a plain step at the step's own context is the choice, wherever in its bucket the
    context lies, under a steep attention slope (the bucket's contexts priced furthest apart)."""
    g = torch.Generator().manual_seed(3)
    for i in range(200):
        u = torch.rand(8, generator=g).tolist()
        c = random_costs(u, 1e-3)
        p, look = Policy(RANDOM_MENU, c, hurdle=HURDLE if i % 2 else 0.0), c.lookup_s
        ctx = 300 + BUCKET * int(50 * u[5]) + i % BUCKET
        beyond = (1 + p.hurdle) / p.expected(VANILLA, [], 100, ctx)[1] / TIE * 1.0001  # a rate just past the ties
        scale = min((beyond * p.expected(Choice(b, 0), [], 100, ctx)[1] - 1) / g for b, g in RANDOM_MENU)
        got = p.choose([], 100, ctx, scale)
        assert not got.vanilla and got == reference_choice(p, [], 100, ctx, scale), (i, u)
        beyond = (1 + p.hurdle) / p.expected(VANILLA, [], 100, ctx, look=look)[1] / TIE * 1.0001
        one = beyond * p.expected(Choice(None, 1), [0.0], 100, ctx, look=look)[1] - 1  # a 1-node draft's tokens
        assert p.choose([one], 100, ctx, 0.0, 0.0, 0.5, look) == Choice(None, 1), (i, u)


def test_choice_follows_the_cost_of_a_wider_forward():
    free = head_policy(costs(0.0))  # verifying more rows costs nothing: the biggest tree
    assert free.choose([], 100) == Choice(B8, 0)
    steep = head_policy(costs(0.5))  # t(5) = 3 t(1): no tree pays
    assert steep.choose([], 100).vanilla
    mid = head_policy(costs(0.1))  # t(5) = 1.4, t(9) = 1.8: the small tree
    assert mid.choose([], 100) == Choice(B4, 0)
    assert mid.choose([], 0).vanilla  # no room left in the context


def test_a_draft_must_beat_a_plain_step_by_the_hurdle():
    """Near break-even a plain step is taken: a tree promising 3% more tokens per second than vanilla is
    not drafted, one promising 8% more is (the hurdle is 5%)."""
    c = Costs({1: 1.0, 5: 1.5, 9: 2.0}, {B4: 0.0, B8: 0.0}, 0.0, 0.0)
    menu = [(B4, 0.5)]  # B4: 1.5 expected tokens for t(5) = 1.5: break-even at scale 1
    assert head_policy(c, menu).choose([], 100, scale=1.03).vanilla
    assert Policy(menu, c).choose([], 100, scale=1.03) == Choice(B4, 0)  # no hurdle (no head)
    assert head_policy(c, menu).choose([], 100, scale=1.25) == Choice(B4, 0)  # 1.625 / 1.5 = 1.083


def test_a_head_tree_after_plain_steps_is_priced_with_its_catch_up():
    """A tree that pays after a drafted step does not pay when the head must first read a stretch of
    plain steps' rows; a lookup chain (no head forward) is not charged for them."""
    p = head_policy(costs(0.1))
    assert p.choose([], 100) == Choice(B4, 0)
    assert p.choose([], 100, catch_up=0.5).vanilla
    gains, look = priced(Calibration(), chain_after(3, 4)), costs(0.1).lookup_s
    chain = p.choose(gains, 100, beyond=0.5, look=look)
    assert chain.budget is None and chain.chain and p.choose(gains, 100, catch_up=0.5, beyond=0.5, look=look) == chain


def test_auto_learns_what_a_catch_up_row_costs(tiny, trained, monkeypatch):
    """The head's reading of skipped rows is timed against the drafting's own price: a head whose catch-up
    takes 20 ms per extra row is learnt as such (from a measured price of 0 here). The engine's clock is one
    that only the catch-up advances: what is learnt is exact, however busy the machine."""
    from types import SimpleNamespace

    from specdec import engine
    from specdec.heads.io import load_head

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine, "_clock", lambda device: clock.now)

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    free = Costs({n: 1 + 0.17 * (n - 1) for n in (1, 2, 5, 9, 17, 33)}, {B4: 0.0, B8: 0.0}, 0.0, 0.0)  # no prior
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the policy mixes vanilla steps and trees
        free.target_s = {n: 1 + slope * (n - 1) for n in free.target_s}
        d = AdaptiveDrafter(free, drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU)
        assert d.catch.row_s == 0.0
        extras = []
        orig = d.model.drafting

        def slow(ctx, budget=None, orig=orig, d=d, extras=extras):
            extra = max(0, sum(f.shape[0] for f, _ in d.model.pending) - 2)
            if len(d.model.pending) > 1 and extra:
                extras.append(extra)
                clock.now += 0.02 * extra
            return (yield from orig(ctx, budget))

        d.model.drafting = slow
        run(target, d, PROMPTS[1], SamplingParams(), 40)
        if extras:
            break
    assert extras
    assert 0.01 < d.catch.row_s < 0.06, (d.catch.row_s, extras)


def test_a_longer_context_prices_every_row_its_attention():
    """Each verified row attends over the whole context: t(n) grows by n * slope per cached token, so a
    tree that pays at a short context is dropped at a long one (long summarization prompts drafted at
    the short-context price and lost 10% to vanilla)."""
    c = costs(0.1)
    c.attend_s, c.ctx = 1e-4, 400
    assert c.target(5) == c.target(5, 400) == pytest.approx(1.4)
    assert c.target(5, 1400) == pytest.approx(1.4 + 5 * 0.1) and c.target(1, 1400) == pytest.approx(1.1)
    assert c.target(5, 0) == pytest.approx(1.4 - 5 * 0.04)  # a short context: less than at the probe's
    assert c.target(5, -10**9) == pytest.approx(0.25 * 1.4)  # floored, whatever the slope
    assert Costs.from_json(c.to_json()).target(5, 1400) == pytest.approx(c.target(5, 1400))
    p = head_policy(c)
    assert p.choose([], 100, ctx=400) == Choice(B4, 0)
    assert p.choose([], 100, ctx=4000).vanilla  # t(5) = 1.4 + 1.8 for 1.9 tokens: does not pay


def test_the_attention_slope_probe_recovers_the_per_row_per_token_cost(monkeypatch):
    """attention_slope times one forward with and without `extra` cached columns visible: a runner whose
    forward costs 20 us per visible (row, column) pair reads as 20 us, whatever the rest costs. Its clock
    is one that only the forwards advance: exact, however busy the machine."""
    from types import SimpleNamespace

    from specdec import machine
    from specdec.machine import attention_slope

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(machine, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class Fake:
        vocab_size, device = 50, torch.device("cpu")

        def reset(self):
            pass

        def pretend_cached(self, n):
            pass

        def commit(self, keep):
            pass

        def rollback(self):
            pass

        def forward(self, xs, positions=None, mask=None, logits_rows=None):
            if mask is not None:
                clock.now += 0.002 + 20e-6 * int(mask.sum())

    slope = attention_slope(Fake(), rows=4, ctx=20, extra=50, reps=3)
    assert slope == pytest.approx(20e-6)


def test_low_acceptance_stops_drafting_and_a_later_try_follows():
    p, s = head_policy(costs(0.1)), TreeScale(1.0)
    assert p.choose([], 100, scale=s.value).budget == B4
    for _ in range(4):  # the text turned hard: nothing accepted
        s.step(True)
        s.observe(0, 0.9)
    assert s.value < 0.5 and p.choose([], 100, scale=s.value).vanilla
    steps = 0
    while p.choose([], 100, scale=s.value).vanilla:  # plain steps observe nothing: the scale drifts back
        s.step(False)
        steps += 1
    assert 3 <= steps <= 40 and p.choose([], 100, scale=s.value).budget == B4


def test_tries_that_fail_in_a_row_come_ever_more_rarely():
    """After a run of trees with nothing accepted, the scale returns to the prior more slowly: the next
    try comes later than from the same scale with no misses counted; one accepted token resets it."""
    p = head_policy(costs(0.1))

    def steps_to_retry(s: TreeScale) -> int:
        n = 0
        while p.choose([], 100, scale=s.value).vanilla:
            s.step(False)
            n += 1
        return n

    s = TreeScale(1.0)
    for _ in range(4):
        s.step(True)
        s.observe(0, 0.9)
    assert s.misses == 4
    same = TreeScale(1.0)
    same.num, same.den = s.num, s.den  # the same scale, no misses counted
    slow, fast = steps_to_retry(s), steps_to_retry(same)
    assert slow >= 2 * fast > 0
    s.step(True)
    s.observe(1, 0.9)
    assert s.misses == 0


def test_steady_acceptance_is_read_as_it_is_not_pulled_toward_the_prior():
    """Text accepting half the table's tokens, step after step: the scale settles at 0.5, and the policy
    stops drafting where half the gain does not pay (a pull toward the prior on every step read it as ~0.66)."""
    p, s = head_policy(costs(0.1)), TreeScale(1.0)
    for _ in range(60):
        b = p.choose([], 100, scale=s.value).budget or B4
        s.step(True)
        s.observe(0.5 * p.gain[b], p.gain[b])
    assert s.value == pytest.approx(0.5, abs=0.01)
    # at t(5) = 1.4 t(1): 1 + 0.9 * 0.5 = 1.45 tokens for 1.46 s does not pay; 1 + 0.9 * 0.66 = 1.59 would
    assert p.choose([], 100, scale=s.value).vanilla


def test_high_acceptance_grows_the_tree():
    p, s = head_policy(costs(0.06)), TreeScale(1.0)
    assert p.choose([], 100, scale=s.value) == Choice(B4, 0)
    for _ in range(6):
        s.step(True)
        s.observe(3, 1.3)
    assert p.choose([], 100, scale=s.value) == Choice(B8, 0)


def test_a_lookup_chain_is_priced_by_the_calibration_of_its_confidences():
    """A chain's nodes are priced by their raw confidences (a long n-gram match copies further) calibrated
    by what chains of like confidence matched: chains that keep matching raise the price and longer
    prefixes get verified; once they miss, the chain is no longer verified."""
    p, cal, look = head_policy(costs(0.06)), Calibration(), costs(0.06).lookup_s
    one, three = chain_after(1, 8), chain_after(3, 8)
    assert priced(cal, one)[-1] < priced(cal, three)[-1] < 2.5  # a priori: about two tokens of eight
    assert p.choose(priced(cal, one), 100, beyond=0.5, look=look).chain <= 2  # a 1-gram match: a token or two
    for _ in range(12):  # the answer repeats itself: 3-gram chains match whole
        cal.step()
        for conf in three.confs:
            cal.observe(conf, True)
    assert priced(cal, three)[-1] > 6
    assert p.choose(priced(cal, three), 100, beyond=0.5, look=look).chain >= 6
    assert p.choose([], 100).chain == 0  # no chain this step: nothing to add
    for _ in range(40):  # the repeats end: chains miss at their first node
        cal.step()
        cal.observe(three.confs[0], False)
    assert priced(cal, three)[-1] < 0.5 * priced(Calibration(), three)[-1]  # under half its prior
    assert not p.choose(priced(cal, three), 100, beyond=0.5, look=look).chain


def test_misses_lower_the_price_of_nodes_of_like_confidence_then_fade():
    """Calibration is by raw confidence, not by n-gram: 2-gram chains that miss at once lower the price of a
    3-gram chain whose first node is as confident, never a node of another confidence; plain steps bring the
    price back to the confidences' own."""
    cal = Calibration()
    two, three = chain_after(2, 12), chain_after(3, 12)
    before = priced(cal, three)
    own = list(itertools.accumulate(math.prod(three.confs[:i + 1]) for i in range(12)))
    assert before == pytest.approx(own)  # no evidence: the confidences' own
    for _ in range(5):  # the prior counts as CAL_PRIOR (4) observations
        cal.step()
        cal.observe(two.confs[0], False)
    assert priced(cal, three)[0] < 0.5 * before[0]
    assert cal.rate(0.95) == pytest.approx(0.95) and cal.rate(0.3) == pytest.approx(0.3)  # other buckets: prior
    for _ in range(150):
        cal.step()
    assert priced(cal, three) == pytest.approx(before, rel=0.01)


def test_calibration_follows_what_the_emitted_tokens_showed():
    cal = Calibration()
    assert cal.rate(0.6) == pytest.approx(0.6)  # no evidence: the draft's own confidence
    for _ in range(40):
        cal.step()
        cal.observe(0.6, True)
    assert cal.rate(0.6) > 0.9 and cal.rate(0.95) == pytest.approx(0.95)  # another bucket is untouched
    r = cal.rate(0.6)
    # a tree: node 1 under node 0, node 2 another root child; each prefix's expected accepted tokens
    assert cal.gains([0.6, 0.6, 0.95], [-1, 0, -1]) == pytest.approx([r, r + r * r, r + r * r + 0.95])
    assert Calibration(0.7).rate(0.6) == pytest.approx(0.7 * 0.6)  # at T > 0: a point mass x is accepted with p(x)


def test_measured_lookup_rates_are_the_calibrations_prior_where_given():
    """tune's measured share per bucket replaces the confidence's own prior there (a one-token match, raw 0.33,
    priced at what the calibration answers showed), the formula stays elsewhere, and evidence still moves it."""
    rates = [None] * (len(EDGES) + 1)
    rates[bisect.bisect_right(EDGES, 0.33)] = 0.1
    cal = Calibration(0.55, rates)
    assert cal.rate(0.33) == pytest.approx(0.1) and cal.rate(0.95) == pytest.approx(0.55 * 0.95)
    for _ in range(40):
        cal.step()
        cal.observe(0.33, True)
    assert cal.rate(0.33) > 0.75
    with pytest.raises(ValueError, match="per calibration bucket"):
        Calibration(1.0, [0.5])


def test_a_union_is_priced_by_what_the_n_gram_part_adds_beyond_the_model_draft():
    """Beyond starts at half (a prior that never fades) and follows the share of the n-gram draft's matched
    tokens that the model's draft beside it did not match, decaying; a weak chain joins a tree only where its
    tokens come beyond the tree's."""
    b = Beyond()
    assert b.share == 0.5
    for _ in range(20):  # the model's draft matched none of what the n-gram draft matched
        b.observe(4, 0)
    assert b.share > 0.95
    for i in range(60):  # the model's draft matched as far, or further
        b.observe(3, 3 + i % 2)
    assert b.share < 0.1
    held = b.share
    for _ in range(100):  # nothing matched: the evidence fades, the share returns toward the prior
        b.observe(0, 2)
    assert held < b.share < 0.5
    p, weak = head_policy(costs(0.01)), [0.5, 0.8, 0.9, 0.95]  # under what the B8 tree expects (1.3)
    assert p.choose(weak, 100, beyond=1.0) == Choice(B8, 4)
    assert p.choose(weak, 100, beyond=0.0) == Choice(B8, 0)


def step_along(d: AdaptiveDrafter, ctx: DecodeContext, text: list[int]) -> DraftTree:
    """One step of d against a target whose answer is `text` (ctx.tokens a prefix of it): the draft verified
    as the engine verifies it (the longest path the text follows, then the text's next token)."""
    at = len(ctx.tokens)
    tree = d.propose(ctx)
    path = greedy_walk(tree, lambda _, k: text[at + k] if at + k < len(text) else None)[0]
    new = text[at:at + len(path) + 1]
    ctx.tokens.extend(new)
    d.accept(ctx, Verdict(path, new, new[-1]))
    return tree


def test_a_union_learns_what_the_n_gram_draft_matched_beyond_the_model_draft():
    """On a step that verifies a model draft and a lookup chain, the chain's matched tokens are scored
    against what the model's draft matched: beyond a draft that matched nothing, the share rises; beside a
    draft that matched as far, it falls. The text repeats, so every chain matches whole."""
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    d = AdaptiveDrafter(costs(0.0, draft=0.0), drafter_for(model, make_head(model, seed=3), True), MENU,
                        PromptLookupDrafter(chain_len=6))
    d.model.begin = d.model.accept = lambda *a: None  # the head's trees are scripted below
    text = [9] + [1, 2, 3, 4, 5, 6, 7, 8] * 20
    ctx = DecodeContext(text[:12], SamplingParams(), None, 12)
    d.begin(ctx)

    def trees(tokens):
        def drafting(c, budget=None):
            return DraftTree.chain(torch.tensor(tokens(len(c.tokens))[:budget.tree_size]))
            yield  # a generator, as drafting() is

        d.model.drafting = drafting

    trees(lambda at: [0] * 8)  # a token the text never has
    before = d.beyond.share
    assert len(step_along(d, ctx, text)) == 8 + 6  # the union: the whole tree and the whole chain
    assert d.beyond.share > 0.9 > before
    trees(lambda at: text[at:])  # the text's own continuation: it matches as far as the chain
    for _ in range(5):
        step_along(d, ctx, text)
    assert d.beyond.share < 0.3


def test_menu_takes_the_best_tau_per_size_and_a_shallow_alternative():
    rows = [{"depth": d, "topk": k, "tree_size": m, "tau": 1 + 0.1 * d + 0.01 * k + 0.02 * m}
            for d in (2, 3, 4, 5) for k in (2, 3, 6) for m in (4, 8)]
    menu = dict(menu_from_tuning(rows))
    assert set(menu) == {TreeBudget(4, 3, 4), TreeBudget(2, 3, 4), TreeBudget(4, 3, 8), TreeBudget(2, 3, 8)}
    assert menu[TreeBudget(4, 3, 8)] == pytest.approx(0.4 + 0.03 + 0.16)
    assert menu_from_tuning([])  # no table: a safe default menu
    noisy = [{"depth": 2, "topk": 2, "tree_size": 3, "tau": 1.66}, {"depth": 3, "topk": 2, "tree_size": 6, "tau": 1.55}]
    assert dict(menu_from_tuning(noisy))[TreeBudget(3, 2, 6)] == pytest.approx(0.66)  # never below a smaller tree


def test_an_unverified_chain_is_followed_until_it_stops_matching():
    """A lookup chain the policy does not verify is scored on the tokens emitted after it (what it would
    have matched), followed over the steps until it misses or matches whole: a chain priced out by its
    confidences is taken up once the text repeats, and dropped again once chains stop matching."""
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    d = AdaptiveDrafter(costs(0.8), drafter_for(model, make_head(model, seed=3), True), MENU,
                        PromptLookupDrafter(chain_len=6))
    d.model.begin = d.model.accept = lambda *a: None  # the head plays no part: no tree pays at these costs
    loop = [1, 2, 3, 4, 5, 6, 7, 8]
    repeats = [40, 41] + loop * 12
    text = repeats + [t for k in range(40) for t in (1, 2, 3, 4, 100 + k)]  # then "1 2 3 4 k": chains miss
    ctx = DecodeContext(text[:13], SamplingParams(), None, 13)
    d.begin(ctx)
    three = chain_after(3, 6)
    prior = priced(d.cal, three)[-1]
    assert not d.policy.choose(priced(d.cal, three), 100, 13, 1.0, 0.0, 0.5, d.costs.lookup_s).chain
    sizes = []
    while len(ctx.tokens) < len(repeats):
        tree = step_along(d, ctx, text)
        if not any(sizes) and not len(tree):  # plain steps so far: each chain followed until it matched whole,
            # which a 6-token chain does on the 6th step: the chains of the last 5 steps are pending
            assert len(d.pending) == min(len(sizes) + 1, 5) and all(len(p.tokens) == 6 for p in d.pending)
        sizes.append(len(tree))
    first = next(i for i, n in enumerate(sizes) if n)
    assert first >= 5 and sum(n > 0 for n in sizes[first:]) > 0.8 * len(sizes[first:])
    assert priced(d.cal, three)[-1] > prior + 2
    sizes.clear()
    while len(ctx.tokens) < len(text) - 8:
        sizes.append(len(step_along(d, ctx, text)))
    assert any(sizes) and not any(sizes[-20:]) and priced(d.cal, three)[-1] < prior


def test_matched_follows_emitted_tokens_through_the_tree():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]))
    assert matched(t, [5, 7, 8, 1]) == 3 and matched(t, [6, 9]) == 1 and matched(t, [9]) == 0
    assert matched(DraftTree.empty(), [1, 2]) == 0


def test_an_adaptive_drafter_needs_a_draft_and_a_menu_only_with_a_model():
    c = costs(0.1)
    with pytest.raises(ValueError, match="needs a model or an n-gram drafter"):
        AdaptiveDrafter(c)
    with pytest.raises(ValueError, match="a menu needs a model"):
        AdaptiveDrafter(c, menu=MENU, ngram=PromptLookupDrafter())
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    with pytest.raises(ValueError, match="a menu needs a model"):
        AdaptiveDrafter(c, drafter_for(model, make_head(model, seed=3), True))
    d = AdaptiveDrafter(c, drafter_for(model, make_head(model, seed=3), True), MENU, PromptLookupDrafter(chain_len=5))
    assert d.name == "eagle2+pld adaptive" and d.draft_depth == 5 and d.lead is d.model
    assert AdaptiveDrafter(c, d.model, MENU).name == "eagle2 adaptive"
    d.model.begin = lambda ctx: None
    for params, scale in ((SamplingParams(), 1.0), (SamplingParams(1.0), SAMPLED_SCALE)):
        d.begin(DecodeContext([1, 2], params, None, 2))  # a head's drafts must beat a plain step by the hurdle
        assert d.policy.hurdle == HURDLE and d.policy.union and d.scale.value == scale
    plain = AdaptiveDrafter(c, ngram=PromptLookupDrafter())
    plain.begin(DecodeContext([1, 2], SamplingParams(), None, 2))
    assert plain.policy.hurdle == 0 and plain.name.endswith("(auto, no head)")


# ---- losslessness with the size changing every step ----

def adaptive_for(model, head, slope, lookup=0, sampled=None):
    eagle = drafter_for(model, head, True, depth=3, topk=3, tree_size=8, children="sample" if sampled else "topk")
    c = costs(slope)
    c.sampled_s = {b: 0.05 * b.tree_size / 4 for b, _ in sampled or []}
    return AdaptiveDrafter(c, eagle, MENU, PromptLookupDrafter(chain_len=lookup) if lookup else None, sampled=sampled)


def test_adaptive_greedy_equals_vanilla_while_the_size_changes(tiny, trained):
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]
    seen, unions = set(), 0
    for slope in (0.02, 0.1, 0.13):
        for lookup in (0, 6):
            drafter = adaptive_for(tiny, head, slope, lookup)
            for p in PROMPTS + [prompt]:
                want, _ = run(target, NoDrafter(), p, SamplingParams(), 40)
                got, stats = run(target, drafter, p, SamplingParams(), 40)
                assert got == want
                seen |= set(stats.tree_sizes)
                unions += drafter.beyond.share != 0.5  # a tree verified beside a chain: what the chain added, learned
    assert 0 in seen and len(seen) >= 3  # plain steps and drafts of several sizes were verified
    assert unions


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)],
                         ids=["T1", "T0.8-topk3-topp0.9"])
def test_adaptive_sampling_matches_the_target_distribution(params):
    model = flat_tiny()
    # at the border: at T > 0 top-k trees are priced at SAMPLED_SCALE of the table; at this slope the 4-node
    # tree pays at the prior (1.495 tokens for 1.26 s) and no longer after two misses: history decides
    drafter = adaptive_for(model, make_head(model, seed=3), 0.05, lookup=3)
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    counts, sizes = sample_first3(target, drafter, prompt, params, whole=True)
    assert 0 in sizes and max(sizes) >= 4  # both vanilla steps and trees among the first tokens
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


SAMPLED_MENU = [(TreeBudget(1, 1, 1), 0.4), (TreeBudget(2, 2, 3), 0.7), (TreeBudget(2, 3, 6), 1.0)]


@pytest.mark.slow
@pytest.mark.parametrize("params,coupled", [  # each sampling and each verification once
    (SamplingParams(0.8, top_k=3, top_p=0.9), False), (SamplingParams(1.0), True)],
    ids=["unseeded-T0.8-topk3-topp0.9", "seeded-T1"])
def test_adaptive_sampled_children_match_the_target_distribution(params, coupled):
    """Sampled requests draft children drawn from the head (sized from the sampled menu), a chain alone
    or nothing, chosen step by step: the first three tokens still follow the target's exact joint."""
    model = flat_tiny()
    drafter = adaptive_for(model, make_head(model, seed=3), 0.1, lookup=3, sampled=SAMPLED_MENU)
    seen = []
    orig = drafter.model.drafting

    def spy(ctx, b=None):
        seen.append(t := (yield from orig(ctx, b)))
        return t

    drafter.model.drafting = spy
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    counts, sizes = sample_first3(target, drafter, prompt, params, coupled=coupled, whole=True)
    assert 0 in sizes and len(set(sizes)) >= 3  # vanilla steps and trees of several sizes
    # unseeded: the trees were sampled ones; seeded: ranked by the coupling's noise (point masses)
    assert seen and all((t.draft_probs is not None) != coupled for t in seen if len(t))
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


def test_a_sampled_request_never_merges_a_sampled_tree_with_the_chain():
    c = costs(0.01)
    c.sampled_s = {b: 0.01 for b, _ in SAMPLED_MENU}
    sure = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    sampled = head_policy(c, SAMPLED_MENU, draft_s=c.sampled_s, union=False)
    assert sampled.choose(sure, 100, beyond=1.0) == Choice(None, 6)  # a sure chain: alone, never joined
    greedy = head_policy(c)
    assert greedy.choose(sure, 100, beyond=1.0) == Choice(B4, 6)  # greedy: the union
    cheap = head_policy(c, SAMPLED_MENU, draft_s=c.sampled_s, union=False)
    assert cheap.choose([], 100, scale=2.0) == Choice(TreeBudget(2, 3, 6), 0)  # priced by the sampled table and costs
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    with pytest.raises(ValueError, match="children='sample'"):  # a top-k drafter cannot serve a sampled menu
        AdaptiveDrafter(c, drafter_for(model, make_head(model, seed=3), True), MENU, sampled=SAMPLED_MENU)
    d = adaptive_for(model, make_head(model, seed=3), 0.01, lookup=3, sampled=SAMPLED_MENU)
    d.model.begin = lambda ctx: None
    d.begin(DecodeContext([1, 2, 1, 2], SamplingParams(1.0), None, 4))
    assert not d.policy.union and d.policy.gain == dict(SAMPLED_MENU) and d.policy.draft_s is d.costs.sampled_s


def test_lazy_head_catch_up_equals_following_every_step(tiny, trained):
    """After vanilla steps the head reads the whole stretch in one forward: same drafts as following."""
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    eager = drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8)
    want, _ = run(target, eager, PROMPTS[1], SamplingParams(), 30)
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the policy mixes vanilla steps and trees
        lazy = AdaptiveDrafter(costs(slope), drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU)
        lazy_trees = []
        orig = lazy.model.drafting

        def spy(ctx, budget=None, orig=orig, lazy_trees=lazy_trees):
            t = yield from orig(ctx, budget)
            lazy_trees.append((len(ctx.tokens), t.tokens.tolist()))
            return t

        lazy.model.drafting = spy
        got, stats = run(target, lazy, PROMPTS[1], SamplingParams(), 30)
        assert got == want
        if 0 in stats.tree_sizes and lazy_trees:
            break
    assert 0 in stats.tree_sizes and lazy_trees
    # each lazy draft equals the draft a head that followed every step makes at the same point
    for n_tokens, toks in lazy_trees:
        ref = drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8)
        seq = PROMPTS[1] + want
        from specdec.drafters.base import DecodeContext

        target.reset()
        out = target.forward(torch.tensor(seq[:n_tokens - 1]))
        target.reset()
        ctx = DecodeContext(seq[:n_tokens], SamplingParams(), None, n_tokens - 1, out.features)
        ref.begin(ctx)
        b = next(b for b, _ in MENU if len(toks) <= b.tree_size)
        assert ref.propose(ctx, b).tokens.tolist()[:len(toks)] == toks


# ---- costs measured here, cached per machine ----

def test_the_catch_up_per_row_is_measured_at_load(tiny, trained, monkeypatch):
    """A head whose reading of queued rows takes 1 ms per row is measured as 1 ms per extra row (the
    catch-up of 10 rows against a typical step's 2), and the price round-trips through the cost file. The
    measurement reads a clock that only that reading advances: exact, however busy the machine."""
    from types import SimpleNamespace

    from specdec.drafters import costs as costs_mod
    from specdec.drafters.costs import measure_costs
    from specdec.heads.io import load_head

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(costs_mod, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    eagle = drafter_for(tiny, head, True)
    real = eagle.syncing

    def slow(ctx):  # the reading of the queued rows, as drafting() runs it
        clock.now += 0.001 * sum(f.shape[0] for f, _ in eagle.pending)
        yield from real(ctx)

    eagle.syncing = slow
    c = measure_costs(LeanRunner(tiny), eagle, MENU, PromptLookupDrafter(chain_len=6), ctx_len=64)
    assert c.follow_s == pytest.approx(0.002) and c.catch_row_s == pytest.approx(0.001), (c.follow_s, c.catch_row_s)
    assert Costs.from_json(c.to_json()).catch_row_s == pytest.approx(c.catch_row_s, abs=1e-7)


def test_costs_are_measured_once_per_key_and_on_request(tiny, trained, tmp_path, monkeypatch, request):
    from specdec import machine
    from specdec.drafters import costs as costs_mod
    from specdec.heads.io import load_head

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(before))
    torch.set_num_threads(2)  # the key's thread count, changed below
    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    eagle = drafter_for(tiny, head, True)
    calls = []
    real = costs_mod.measure_costs
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    c1, path, fresh = load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h")
    assert fresh.startswith("measured at load in ") and path.is_file() and len(calls) == 1
    assert set(c1.draft_s) == {B4, B8} and c1.target(1) > 0 and c1.target(33) >= c1.target(1)
    assert c1.ctx > 0 and c1.attend_s >= 0  # the context the sizes were timed at, and the attention slope
    c2, path2, fresh = load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h")
    assert fresh == "cached" and path2 == path and c2.to_json() == c1.to_json() and len(calls) == 1
    load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h", recalibrate=True)
    assert len(calls) == 2
    # a re-measure while another process is busy serves its command only: the stored costs stay
    stored = path.read_text()
    monkeypatch.setattr(machine.ContentionMeter, "result", lambda self: {"other_cpu_frac": 0.6})
    c3, _, fresh = load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h", recalibrate=True)
    assert "not stored: other processes used 60%" in fresh and len(calls) == 3 and path.read_text() == stored
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.set_num_threads(1)
    try:  # another thread count is another key
        _, path3, fresh = load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h")
    finally:
        torch.set_num_threads(2)
    assert fresh != "cached" and path3 != path and len(calls) == 4
    path.write_text("{ not json")  # a damaged entry is measured again
    _, _, fresh = load_costs(target, eagle, MENU, PromptLookupDrafter(chain_len=6), "h")
    assert fresh != "cached" and json.loads(path.read_text())["key"]["threads"] == 2


def test_step_clock_flags_forwards_far_from_their_price_and_learns_per_size_class():
    near, slow, fast = StepClock(min_steps=10), StepClock(min_steps=10), StepClock(min_steps=10)
    for _ in range(9):
        for c, seen in ((near, 1.05), (slow, 2.0), (fast, 0.4)):
            c.observe(seen, 1.0)
    assert not any(c.drifted for c in (near, slow, fast))  # too few steps to tell
    for c, seen in ((near, 1.05), (slow, 2.0), (fast, 0.4)):
        c.observe(seen, 1.0)
    assert not near.drifted and slow.drifted and fast.drifted
    clock = StepClock(min_steps=10)  # one-row forwards 3x their price, 8-row ones as priced
    for _ in range(400):
        clock.observe(3.0, 1.0, rows=1)
        clock.observe(2.0, 2.0, rows=8)
    f = clock.factors()
    seen, priced, _ = clock.sums[len(SIZE_CLASSES)]
    overall = seen / priced
    assert f[size_class(1)] > 2.5 and f[size_class(8)] < 1.2  # mostly each class's own ratio (3 and 1)
    assert f[size_class(20)] == f[size_class(3)] == pytest.approx(overall)  # never seen: the overall ratio
    c = costs(0.1).rescaled(f)
    assert c.target(5) == pytest.approx(1.4 * f[size_class(8)]) and c.target(17) == pytest.approx(2.6 * overall)
    assert c.target(1) == min(c.target_s.values()) < 3.0  # 3x, floored: one row never costs more than a wider forward
    assert c.draft_s[B4] == pytest.approx(0.05 * f[0])  # drafting runs on the same loaded machine
    hiccup = StepClock(min_steps=10)  # three 5-row forwards during a hiccup among plain steps as priced
    for i in range(100):
        hiccup.observe(1.45 if i % 30 == 0 else 1.0, 1.0, rows=5 if i % 30 == 0 else 1)
    assert hiccup.factors()[size_class(5)] < 1.15  # mostly the overall ratio: too few to price 5-row forwards by
    assert not clock.restarted().drifted and clock.restarted().steps == 0


def test_step_clock_flags_one_size_class_or_the_drafting_off_its_price():
    """In total within the drift, yet one-row forwards 15% under their price (the README demo prompt's
    case: it flips choices near break-even), or drafting 40% over its price: drifted, and rescaled."""
    one = StepClock(min_steps=10)
    for _ in range(40):
        one.observe(0.85, 1.0, rows=1)
        one.observe(1.96, 2.0, rows=3)
    seen, priced, _ = one.sums[len(SIZE_CLASSES)]
    assert 1 / one.drift <= seen / priced and one.drifted
    drafting = StepClock(min_steps=10)
    for _ in range(40):
        drafting.observe(1.0, 1.0, rows=3)
        drafting.observe_draft(0.07, 0.05)
    assert drafting.drifted and drafting.draft_factor() == pytest.approx(1.4)
    c = costs(0.1).rescaled(drafting.factors(), drafting.draft_factor())
    assert c.draft_s[B4] == pytest.approx(0.07) and c.target(3) == pytest.approx(1.2)


def test_costs_follow_the_forwards_between_requests_without_a_measurement(tiny, trained, monkeypatch):
    """Costs priced far off the observed forwards (as if cached on an idle machine, then another process
    made wide forwards dear) are rescaled to them before the next request, never within one (its text
    must not depend on timing), and no request runs a measurement: the prices come from the steps run."""
    from specdec.drafters import costs as costs_mod
    from specdec.heads.io import load_head

    # scripted forwards: 1 ms for one row and 2 ms more per extra row, whatever the machine does (the real
    # timings of 1 ms forwards wander when other tests share the 2 cores)
    observe = StepClock.observe
    monkeypatch.setattr(StepClock, "observe", lambda self, seconds, priced, rows=1: observe(
        self, 1e-3 * (1 + 2.0 * (rows - 1)), priced, rows))
    measured = []
    for name in ("measure_costs", "forward_costs"):
        monkeypatch.setattr(costs_mod, name, lambda *a, **k: measured.append(1))
    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    d = adaptive_for(tiny, head, 0.02)  # priced nearly flat: wide trees pay
    d.clock = StepClock(min_steps=30)
    seeded = SamplingParams(1.0, seed=3)
    want_seeded, _ = run(target, d, PROMPTS[0], seeded, 40)
    want, _ = run(target, NoDrafter(), PROMPTS[0], SamplingParams(), 40)
    got, first = run(target, d, PROMPTS[0], SamplingParams(), 40)
    assert got == want and max(first.tree_sizes) > 0 and d.relearned == 0 and first.costs == "given"
    # noted, priced when the clock is next read (all but a last forward that ended the answer)
    assert len(first.tree_sizes) - 1 <= len(d.clock.log) <= len(first.tree_sizes)
    d.clock.settle(d.costs.target)
    assert d.clock.drifted and not d.clock.log
    got, after = run(target, d, PROMPTS[0], SamplingParams(), 40)
    # priced as they ran (steep), wide trees no longer pay: smaller drafts, the same text
    assert got == want and d.relearned == 1 and after.costs == "given, then learned online (1x)"
    assert sum(after.tree_sizes) / len(after.tree_sizes) < sum(first.tree_sizes) / len(first.tree_sizes)
    # a seeded sampled request's text is the target's coupled draws: the same after the prices changed
    # the drafts (another thread's load must not change it), and vanilla's
    got_seeded, _ = run(target, d, PROMPTS[0], seeded, 40)
    assert got_seeded == want_seeded == run(target, NoDrafter(), PROMPTS[0], seeded, 40)[0]
    assert not measured


def test_auto_is_adaptive_by_default_and_static_on_request(tiny, trained, tmp_path, monkeypatch):
    from specdec.api import from_models
    from specdec.drafters.union import UnionDrafter

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    head_dir = str(trained[1] / "head")
    dec = from_models(tiny, None, "auto", head=head_dir)
    assert isinstance(dec.drafter, AdaptiveDrafter) and dec.method == "eagle2"
    # a head `specdec tune` has not measured drafts beside the n-gram tree auto drafts without a head; one
    # asked for with lookup=, beside the prompt-lookup chain of that length (or none)
    assert load_tuning(head_dir) is None and isinstance(dec.drafter.ngram, NgramDrafter)
    assert dec.drafter.ngram.tree_size == from_models(tiny, None, "auto").drafter.ngram.tree_size
    chain = from_models(tiny, None, "auto", head=head_dir, lookup=3).drafter.ngram
    assert isinstance(chain, PromptLookupDrafter) and chain.chain_len == 3
    assert from_models(tiny, None, "auto", head=head_dir, lookup=0).drafter.ngram is None
    # a tuned head: the chain its tuning found paying, or the n-gram tree where it found none
    for lookup in (4, 0):
        tuned = tmp_path / f"tuned{lookup}"
        shutil.copytree(head_dir, tuned)
        save_tuning({"depth": 2, "topk": 2, "tree_size": 2,
                     "auto": {"depth": 2, "topk": 2, "tree_size": 2, "lookup": lookup}}, tuned / "tuning.json")
        assert load_tuning(tuned, auto=True)["lookup"] == lookup
        ngram = from_models(tiny, None, "auto", head=str(tuned)).drafter.ngram
        assert ngram.chain_len == 4 if lookup else isinstance(ngram, NgramDrafter)
    seeded = SamplingParams(1.0, seed=3)  # the head's trees joined with the n-gram tree: still the target's draws
    assert run(dec.runner, dec.drafter, PROMPTS[1], seeded, 30)[0] == \
        run(LeanRunner(tiny), NoDrafter(), PROMPTS[1], seeded, 30)[0]
    static = from_models(tiny, None, "auto", head=head_dir, adaptive=False, lookup=4)
    assert isinstance(static.drafter, UnionDrafter)
    pinned = from_models(tiny, None, "auto", head=head_dir, depth=2)  # an explicit budget pins the tree
    assert not isinstance(pinned.drafter, AdaptiveDrafter)
    want, _ = run(LeanRunner(tiny), NoDrafter(), PROMPTS[3], SamplingParams(), 30)
    got, stats = run(dec.runner, dec.drafter, PROMPTS[3], SamplingParams(), 30)
    assert got == want
    s = stats.summary()
    assert sum(s["tree_size_histogram"].values()) == stats.target_forwards and 0 <= s["vanilla_share"] <= 1


def test_a_head_catching_up_after_plain_steps_is_observed_at_its_price_with_the_catch_up(tiny, trained):
    """The first draft after a stretch of plain steps also reads those steps' rows: the clock times it
    against its drafting's price plus the catch-up's (timed against one step's drafting it read as dear
    drafting, and fewer drafts, longer catch-ups); a catch-up of more rows than are counted is not observed."""
    from specdec.drafters.clock import PRICED_ROWS, CatchUp
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)

    def drive(slope, prompt):
        d = AdaptiveDrafter(costs(slope), drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU,
                            clock=StepClock())
        wanted, observed = [], []
        orig = d.model.drafting

        def spy(ctx, budget=None):
            extra = CatchUp.extra_rows(d.model.pending)
            price = d.policy.draft_s[budget] + d.costs.follow_s + d.catch.price(extra)
            wanted.append((d.model.unread_steps, extra, price))
            return (yield from orig(ctx, budget))

        d.model.drafting = spy
        d.clock.observe_draft = lambda seconds, priced: observed.append(priced)
        run(target, d, prompt, SamplingParams(), 40)
        assert observed == [p for _, e, p in wanted if e <= PRICED_ROWS] and all(p > 0 for p in observed)
        return wanted

    counted = uncounted = False
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the policy mixes vanilla steps and trees
        counted |= any(b > 1 and 0 < e <= PRICED_ROWS for b, e, _ in drive(slope, PROMPTS[1]))
        uncounted |= any(e > PRICED_ROWS for _, e, _ in drive(slope, PROMPTS[3]))  # the first tree reads 28
        if counted and uncounted:
            break
    assert counted and uncounted
