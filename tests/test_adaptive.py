"""Adaptive speculation (`auto`): the controller's choices, the cost cache, and losslessness with the
draft size changing from step to step (greedy equality, chi-square at T > 0 with top-k / top-p)."""

import itertools
import json
import random

import pytest
import torch

from specdec.drafters.adaptive import AdaptiveDrafter, matched
from specdec.drafters.base import NoDrafter
from specdec.drafters.clock import StepClock
from specdec.drafters.controller import Choice, Controller, menu_from_tuning, prefixes
from specdec.drafters.costs import Costs, load_costs, size_class
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeBudget
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


def geometric_tail(mean: float, length: int = 12) -> tuple[float, ...]:
    """P(a chain matches at least i tokens), i = 1..length, when each token continues a match with a fixed
    chance a and a + a^2 + ... + a^length = mean."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(1, length + 1)) < mean else (lo, a)
    return tuple(lo ** i for i in range(1, length + 1))


# a lookup chain's prior by the n-gram it matched: matched tokens 0.5, 1.0, 1.5 in a geometric tail
PRIOR = {n: geometric_tail(m) for n, m in {1: 0.5, 2: 1.0, 3: 1.5}.items()}


def pick(ctrl: Controller, chain_len: int, room: int = 100, ngram: int = 0, **kw) -> Choice:
    """The controller's choice for a lookup chain of chain_len tokens after an n-gram match, priced by
    what it learnt of such chains (AdaptiveDrafter.propose's call)."""
    return ctrl.choose(chain_len, room, gains=ctrl.chain_gains(ngram, chain_len) if chain_len else None,
                       beyond=ctrl.chain_beyond(ngram) if chain_len else None, **kw)


def costs(slope: float, draft: float = 0.05) -> Costs:
    """t(N) = 1 + slope * (N - 1) seconds (a unit forward), drafts `draft` each."""
    return Costs({n: 1 + slope * (n - 1) for n in (1, 2, 5, 9, 17, 33)}, {B4: draft, B8: 2 * draft}, 0.01, 0.001)


# ---- the controller ----

def test_a_disturbed_one_row_forward_is_floored_by_the_wider_ones():
    from specdec.drafters.costs import floor_one_row

    assert floor_one_row({1: 44.0, 2: 32.0, 5: 39.0}) == {1: 32.0, 2: 32.0, 5: 39.0}
    assert floor_one_row({1: 30.0, 2: 37.0, 5: 32.0}) == {1: 30.0, 2: 37.0, 5: 32.0}  # wider sizes untouched
    cached = Costs({1: 44.0, 2: 32.0, 5: 39.0}, {}, 0.0, 0.0).to_json()  # as an older cache file holds it
    assert Costs.from_json(cached | {"target_ms": {"1": 44.0, "2": 32.0, "5": 39.0}}).target(1) == pytest.approx(0.032)


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

    ctrl = Controller([], c, 1.0, {2: (0.3, 0.3, 0.3, 0.3)})
    assert pick(ctrl, 4, ngram=2).chain > 0  # alone: 1.3 tokens a step for t(2) = 1.1
    ctrl.reprice(c.shared(4), 4)
    assert pick(ctrl, 4, ngram=2).vanilla  # shared by 4: a row adds 0.1 to a 0.325 share
    sure = Controller([], c.shared(4), 1.0, {2: (0.95, 0.95, 0.95, 0.95)})
    assert pick(sure, 4, ngram=2).chain > 0
    ctrl.reprice(c, 1)
    assert pick(ctrl, 4, ngram=2).chain > 0


def test_costs_interpolate_between_and_beyond_measured_sizes():
    c = Costs({1: 1.0, 5: 2.0, 9: 4.0}, {}, 0.0, 0.0)
    assert c.target(1) == 1.0 and c.target(3) == pytest.approx(1.5) and c.target(7) == pytest.approx(3.0)
    assert c.target(13) == pytest.approx(6.0)  # along the last segment
    assert Costs({1: 1.0, 5: 2.0, 9: 1.5}, {}, 0.0, 0.0).target(33) == pytest.approx(1.5)  # never below the last
    c.target_s = {1: 2.0, 5: 4.0, 9: 8.0}  # new prices (as tests and rescaling set them): no stale table
    assert c.target(3) == pytest.approx(3.0) and c.target(13) == pytest.approx(12.0)


def reference_choice(ctrl: Controller, chain_len: int, room: int, ctx, gains, catch_up=0.0, beyond=None) -> Choice:
    """The choice spelled out: every option priced by `expected`, the best rate (vanilla's raised by the
    hurdle), ties within 0.5% to the earliest option. A tree + chain is an option where the chain adds
    expected tokens beyond the tree's."""
    options = [Choice(None, 0)]
    if room > 0:
        options += [Choice(b, 0) for b, _ in ctrl.menu]
        for m in prefixes(chain_len, room):
            options.append(Choice(None, m))
            for b, g in ctrl.menu if ctrl.union else []:
                n = min(m, room - min(b.tree_size, room))
                tree = ctrl.scale * g * min(b.tree_size, room) / b.tree_size
                if n > 0 and ctrl.added(gains[n - 1], tree, beyond) > 0:
                    options.append(Choice(b, m))
    rates = []
    for o in options:
        tokens, secs = ctrl.expected(o, chain_len, room, ctx, gains, catch_up, beyond)
        rates.append(tokens / secs * (1 + ctrl.hurdle if o.vanilla and not o.chain else 1))
    best = max(rates)
    return next(o for o, r in zip(options, rates) if r >= best * 0.995)


RANDOM_MENU = [(TreeBudget(2, 2, 4), 0.9), (TreeBudget(3, 3, 8), 1.3), (TreeBudget(4, 4, 16), 1.6)]


def random_costs(u: list[float], attend: float) -> Costs:
    """Costs from uniforms u[0..4]: t(n)'s slope, the drafts, follow, lookup and the attention slope."""
    return Costs({n: 1 + u[0] * 0.3 * (n - 1) for n in (1, 2, 5, 9, 17, 33)},
                 {b: 0.3 * u[1] * b.tree_size / 4 for b, _ in RANDOM_MENU}, 0.05 * u[2], 0.01 * u[3],
                 attend_s=attend * u[4], ctx=300)


def test_a_plain_step_below_the_tree_bar_is_the_choice_pricing_every_tree_makes():
    """Without a chain, a tree scale under the bar of the context's bucket skips pricing the trees: the
    choice is still the one every option priced gives, on both sides of the bar and at every context."""
    g = torch.Generator().manual_seed(1)
    below = drafted = 0
    for _ in range(300):
        u = torch.rand(8, generator=g).tolist()
        ctrl = Controller(RANDOM_MENU, random_costs(u, 1e-3), 1.0, PRIOR)
        ctx = int(3000 * u[5])
        bar = ctrl.plain_bounds(ctx, False)[2]  # no tree beats a plain step below this scale
        ctrl.num = ctrl.den * bar * (0.8 + 0.4 * u[6])  # a scale within 20% of the bar, either side
        catch_up = 0.1 * u[7]
        got = ctrl.choose(0, 100, ctx, None, catch_up)
        assert got == reference_choice(ctrl, 0, 100, ctx, None, catch_up)
        below += ctrl.scale < bar
        drafted += not got.vanilla
    assert below > 100 and drafted > 30


def test_the_step_choice_is_the_best_priced_option_over_random_states():
    g = torch.Generator().manual_seed(0)
    differ = unions = 0
    for i in range(400):
        u = torch.rand(12, generator=g).tolist()
        ctrl = Controller(RANDOM_MENU, random_costs(u, 1e-4), 0.3 + 1.5 * u[5], PRIOR, union=u[6] < 0.7)
        ctrl.observe_chain(2, int(12 * u[7]), 12, int(3 * u[8]))
        chain_len = int(u[9] * 14)
        room = [0, 3, 7, 100][i % 4]
        gains = ctrl.chain_gains(2, chain_len) if i % 3 else \
            [sum(0.9 ** j * 3 * u[10] for j in range(1, m + 1)) for m in range(1, chain_len + 1)]
        ctx = [None, 50, 2000][i % 3]
        catch_up = [0.0, 0.1 * u[11]][i % 2]
        beyond = ctrl.chain_beyond(2) if i % 5 else None
        got = ctrl.choose(chain_len, room, ctx, gains, catch_up, beyond)
        assert got == reference_choice(ctrl, chain_len, room, ctx, gains, catch_up, beyond), (i, u)
        differ += got != Choice(None, 0)
        unions += got.budget is not None and got.chain > 0
    assert differ > 100 and unions >= 3  # the states cover drafting choices, unions among them


def test_choice_follows_the_cost_of_a_wider_forward():
    free = Controller(MENU, costs(0.0), 1.0, PRIOR)  # verifying more rows costs nothing: the biggest tree
    assert free.choose(0, 100) == Choice(B8, False)
    steep = Controller(MENU, costs(0.5), 1.0, PRIOR)  # t(5) = 3 t(1): no tree pays
    assert steep.choose(0, 100).vanilla
    mid = Controller(MENU, costs(0.1), 1.0, PRIOR)  # t(5) = 1.4, t(9) = 1.8: the small tree
    assert mid.choose(0, 100) == Choice(B4, False)
    assert mid.choose(0, 0).vanilla  # no room left in the context


def test_a_draft_must_beat_a_plain_step_by_the_hurdle():
    """Near break-even a plain step is taken: a tree promising 3% more tokens per second than vanilla is
    not drafted, one promising 8% more is (the hurdle is 5%)."""
    c = Costs({1: 1.0, 5: 1.5, 9: 2.0}, {B4: 0.0, B8: 0.0}, 0.0, 0.0)
    menu = [(B4, 0.5)]  # B4: 1.5 expected tokens for t(5) = 1.5: break-even at scale 1
    assert Controller(menu, c, 1.03, {}).choose(0, 100).vanilla
    assert Controller(menu, c, 1.03, {}, hurdle=0.0).choose(0, 100) == Choice(B4, False)
    assert Controller(menu, c, 1.25, {}).choose(0, 100) == Choice(B4, False)  # 1.625 / 1.5 = 1.083


def test_a_head_tree_after_plain_steps_is_priced_with_its_catch_up():
    """A tree that pays after a drafted step does not pay when the head must first read a stretch of
    plain steps' rows; a chain (no head forward) is not charged for them."""
    c = costs(0.1)
    ctrl = Controller(MENU, c, 1.0, PRIOR)
    assert ctrl.choose(0, 100) == Choice(B4, False)
    assert ctrl.choose(0, 100, catch_up=0.5).vanilla
    chain = pick(ctrl, 4, ngram=3)
    assert chain.budget is None and chain.chain and pick(ctrl, 4, ngram=3, catch_up=0.5) == chain


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
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the controller mixes vanilla steps and trees
        free.target_s = {n: 1 + slope * (n - 1) for n in free.target_s}
        d = AdaptiveDrafter(drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU, free, 0)
        assert d.catch.row_s == 0.0
        extras = []
        orig = d.eagle.drafting

        def slow(ctx, budget=None, orig=orig, d=d, extras=extras):
            extra = max(0, sum(f.shape[0] for f, _ in d.eagle.pending) - 2)
            if len(d.eagle.pending) > 1 and extra:
                extras.append(extra)
                clock.now += 0.02 * extra
            return (yield from orig(ctx, budget))

        d.eagle.drafting = slow
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
    ctrl = Controller(MENU, c, 1.0, PRIOR)
    assert ctrl.choose(0, 100, ctx=400) == Choice(B4, False)
    assert ctrl.choose(0, 100, ctx=4000).vanilla  # t(5) = 1.4 + 1.8 for 1.9 tokens: does not pay


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
    c = Controller(MENU, costs(0.1), 1.0, PRIOR)
    assert c.choose(0, 100).budget == B4
    for _ in range(4):  # the text turned hard: nothing accepted
        c.step(tree_observed=True)
        c.observe_tree(0, 0.9)
    assert c.scale < 0.5 and c.choose(0, 100).vanilla
    steps = 0
    while c.choose(0, 100).vanilla:  # vanilla steps observe nothing: the estimate drifts back to the prior
        c.step()
        steps += 1
    assert 3 <= steps <= 40 and c.choose(0, 100).budget == B4


def test_tries_that_fail_in_a_row_come_ever_more_rarely():
    """After a run of trees with nothing accepted, the estimate returns to the prior more slowly: the next
    try comes later than from the same estimate with no misses counted; one accepted token resets it."""

    def steps_to_retry(c: Controller) -> int:
        n = 0
        while c.choose(0, 100).vanilla:
            c.step()
            n += 1
        return n

    c = Controller(MENU, costs(0.1), 1.0, PRIOR)
    for _ in range(4):
        c.step(tree_observed=True)
        c.observe_tree(0, 0.9)
    assert c.misses == 4
    same = Controller(MENU, costs(0.1), 1.0, PRIOR)
    same.num, same.den = c.num, c.den  # the same estimate, no misses counted
    slow, fast = steps_to_retry(c), steps_to_retry(same)
    assert slow >= 2 * fast > 0
    c.step(tree_observed=True)
    c.observe_tree(1, 0.9)
    assert c.misses == 0


def test_steady_acceptance_is_read_as_it_is_not_pulled_toward_the_prior():
    """Text accepting half the table's tokens, step after step: the estimate settles at 0.5, and the
    controller stops drafting where half the gain does not pay (the prior pull once read it as ~0.66)."""
    c = Controller(MENU, costs(0.1), 1.0, PRIOR)
    for _ in range(60):
        b = c.choose(0, 100).budget or B4
        c.step(tree_observed=True)
        c.observe_tree(0.5 * c.gain[b], c.gain[b])
    assert c.scale == pytest.approx(0.5, abs=0.01)
    # at t(5) = 1.4 t(1): 1 + 0.9 * 0.5 = 1.45 tokens for 1.46 s does not pay; 1 + 0.9 * 0.66 = 1.59 did
    assert c.choose(0, 100).vanilla


def test_high_acceptance_grows_the_tree_and_a_good_chain_is_used():
    c = Controller(MENU, costs(0.06), 1.0, PRIOR)
    assert c.choose(0, 100) == Choice(B4, False)
    for _ in range(6):
        c.step(tree_observed=True)
        c.observe_tree(3, 1.3)
    assert c.choose(0, 100) == Choice(B8, False)
    assert pick(c, 8, ngram=1).chain <= 2  # a 1-gram match is a poor bet a priori: a token or two at most
    for _ in range(6):  # the answer repeats itself: chains of 8 from 3-gram matches match 7 tokens
        c.step()
        c.observe_chain(3, 7, 8, 3)
    assert pick(c, 8, ngram=3).chain >= 6  # (alone here: 7 tokens for t(9) beat the tree + chain)
    assert pick(c, 8, ngram=1).chain <= 2  # evidence about 3-gram matches says nothing of 1-gram ones
    assert c.choose(0, 100).chain == 0  # no chain this step: nothing to add
    for _ in range(40):  # the repeats end: chains stop matching
        c.step()
        c.observe_chain(3, 0, 8)
    assert not pick(c, 8, ngram=3).chain


def test_a_chain_prefix_is_priced_by_how_far_chains_matched():
    """Chains that match their first two tokens and then stop: the controller verifies a short prefix,
    not the whole chain (a failed 12-token chain costs t(13)); the same evidence decays toward the prior
    over plain steps without being touched on each of them."""
    c = Controller(MENU, costs(0.1), 1.0, PRIOR)
    for _ in range(10):
        c.step()
        c.observe_chain(3, 2, 12)
    gains = c.chain_gains(3, 12)
    assert gains[1] > 1.6 and gains[-1] - gains[1] < 0.5
    assert 2 <= pick(c, 12, ngram=3).chain <= 3
    est = c.chain[3]
    for _ in range(200):
        c.step()
    assert est.at < c.now  # nothing touched it over the plain steps
    assert c.chain_gains(3, 12) == pytest.approx(list(itertools.accumulate(geometric_tail(1.5))), abs=1e-3)


def test_one_n_grams_misses_lower_the_price_of_another_then_fade():
    """A text whose 1-gram chains all miss prices its next 3-gram chain lower too (the README demo prompt's
    answer repeats no phrase of any length); plain steps bring the price back to the prior."""
    c = Controller(MENU, costs(0.1), 1.0, PRIOR)
    before = c.chain_gains(3, 12)[2]
    for _ in range(3):
        c.step()
        c.observe_chain(1, 0, 12)
    assert c.chain_gains(3, 12)[2] < 0.5 * before
    for _ in range(150):
        c.step()
    assert c.chain_gains(3, 12)[2] == pytest.approx(before, rel=0.05)
    before2 = c.chain_gains(2, 12)[5]
    c.observe_chain(2, 6, 12)  # one long match raises its own n-gram's estimate, not the others'
    assert c.chain_gains(3, 12)[2] == pytest.approx(before, rel=0.05)
    assert c.chain_gains(2, 12)[5] > 1.5 * before2


def test_a_chains_bound_holds_at_every_later_step_until_it_is_observed():
    """chain_bound lets a step skip pricing its chain: it must be at least what chain_gains gives for every
    length at every step until the chain's n-gram is next observed, over random histories; a plain step it
    declares sure is the one choose() makes with the chain priced."""
    rng = random.Random(5)
    for _ in range(60):
        c = Controller(MENU, costs(0.1), 1.0, PRIOR)
        for _ in range(rng.randrange(0, 30)):
            c.step()
            n, length = rng.choice([1, 2, 3]), rng.randrange(1, 20)
            c.observe_chain(n, rng.randrange(0, length + 1), length)
        for _ in range(rng.randrange(0, 60)):
            for n in (1, 2, 3):
                for length in (1, 2, 5, 12, 19, 31):
                    assert c.chain_bound(n, length) >= c.chain_gains(n, length)[-1] - 1e-12
            length = rng.randrange(1, 32)
            if c.surely_plain(64, 300, 0.0, c.chain_bound(3, length)):
                assert c.choose(length, 64, 300, c.chain_gains(3, length), 0.0, c.chain_beyond(3)).vanilla
            c.step()


def test_menu_takes_the_best_tau_per_size_and_a_shallow_alternative():
    rows = [{"depth": d, "topk": k, "tree_size": m, "tau": 1 + 0.1 * d + 0.01 * k + 0.02 * m}
            for d in (2, 3, 4, 5) for k in (2, 3, 6) for m in (4, 8)]
    menu = dict(menu_from_tuning(rows))
    assert set(menu) == {TreeBudget(4, 3, 4), TreeBudget(2, 3, 4), TreeBudget(4, 3, 8), TreeBudget(2, 3, 8)}
    assert menu[TreeBudget(4, 3, 8)] == pytest.approx(0.4 + 0.03 + 0.16)
    assert menu_from_tuning([])  # no table: a safe default menu
    noisy = [{"depth": 2, "topk": 2, "tree_size": 3, "tau": 1.66}, {"depth": 3, "topk": 2, "tree_size": 6, "tau": 1.55}]
    assert dict(menu_from_tuning(noisy))[TreeBudget(3, 2, 6)] == pytest.approx(0.66)  # never below a smaller tree


def test_an_unverified_chain_is_followed_until_it_stops_matching(tiny, trained):
    """A chain the controller did not verify is scored on the tokens emitted after it (what it would have
    matched), so a chain priced out by its prior is taken up once the text repeats."""
    from specdec.drafters.base import DecodeContext
    from specdec.heads.io import load_head
    from specdec.verify import Verdict

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    d = AdaptiveDrafter(drafter_for(tiny, head, True), MENU, costs(0.7), lookup=6)
    d.eagle.begin = d.eagle.accept = lambda *a: None  # the head plays no part here
    ctx = DecodeContext([40, 41], SamplingParams(), None, 1)
    d.begin(ctx)
    assert not pick(d.ctrl, 6, ngram=3).chain  # t(2) = 1.7 t(1): the 3-gram prior (1.5 tokens of 12) does not pay
    chain = [1, 2, 3, 4, 5, 6]

    def vanilla_step(tok, with_chain):
        d.last = (Choice(None, 0), None, 0.0, chain if with_chain else None, 3)
        ctx.tokens.append(tok)
        d.accept(ctx, Verdict([], [tok], tok))

    for _ in range(3):  # the text repeats the chain, one plain step at a time
        for i, tok in enumerate([1, 2, 3, 4, 5, 6]):
            vanilla_step(tok, i == 0)
            assert len(d.pending) == (i < 5)  # followed until it matched whole
    assert d.ctrl.chain_gains(3, 6)[-1] > 3 and pick(d.ctrl, 6, ngram=3).chain
    vanilla_step(1, True)
    vanilla_step(9, False)  # stops matching after one token: scored 1
    assert not d.pending
    before = d.ctrl.chain_gains(3, 6)[-1]
    for _ in range(30):
        vanilla_step(1, True)
        vanilla_step(9, False)
    assert d.ctrl.chain_gains(3, 6)[-1] < min(before, 1.5)


def test_matched_follows_emitted_tokens_through_the_tree():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]))
    assert matched(t, [5, 7, 8, 1]) == 3 and matched(t, [6, 9]) == 1 and matched(t, [9]) == 0
    assert matched(DraftTree.empty(), [1, 2]) == 0


# ---- losslessness with the size changing every step ----

def adaptive_for(model, head, slope, lookup=0, sampled_scale=1.0, sampled=None):
    eagle = drafter_for(model, head, True, depth=3, topk=3, tree_size=8, children="sample" if sampled else "topk")
    c = costs(slope)
    c.sampled_s = {b: 0.05 * b.tree_size / 4 for b, _ in sampled or []}
    return AdaptiveDrafter(eagle, MENU, c, lookup, sampled_scale=sampled_scale, sampled=sampled)


def test_adaptive_greedy_equals_vanilla_while_the_size_changes(tiny, trained):
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]
    seen = set()
    for slope in (0.02, 0.1, 0.13):
        for lookup in (0, 6):
            drafter = adaptive_for(tiny, head, slope, lookup)
            for p in PROMPTS + [prompt]:
                want, _ = run(target, NoDrafter(), p, SamplingParams(), 40)
                got, stats = run(target, drafter, p, SamplingParams(), 40)
                assert got == want
                seen |= set(stats.tree_sizes)
    assert 0 in seen and len(seen) >= 3  # vanilla steps and trees of several sizes were verified


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)],
                         ids=["T1", "T0.8-topk3-topp0.9"])
def test_adaptive_sampling_matches_the_target_distribution(params):
    model = flat_tiny()
    drafter = adaptive_for(model, make_head(model, seed=3), 0.17, lookup=3)  # at the border: history decides
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    counts, sizes = sample_first3(target, drafter, prompt, params, whole=True)
    assert 0 in sizes and max(sizes) >= 4  # both vanilla steps and trees among the first tokens
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


SAMPLED_MENU = [(TreeBudget(1, 1, 1), 0.4), (TreeBudget(2, 2, 3), 0.7), (TreeBudget(2, 3, 6), 1.0)]


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)],
                         ids=["T1", "T0.8-topk3-topp0.9"])
@pytest.mark.parametrize("coupled", [False, True], ids=["unseeded", "seeded"])
def test_adaptive_sampled_children_match_the_target_distribution(params, coupled):
    """Sampled requests draft children drawn from the head (sized from the sampled menu), a chain alone
    or nothing, chosen step by step: the first three tokens still follow the target's exact joint."""
    model = flat_tiny()
    drafter = adaptive_for(model, make_head(model, seed=3), 0.1, lookup=3, sampled=SAMPLED_MENU)
    seen = []
    orig = drafter.eagle.drafting

    def spy(ctx, b=None):
        seen.append(t := (yield from orig(ctx, b)))
        return t

    drafter.eagle.drafting = spy
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
    ctrl = Controller(SAMPLED_MENU, c, 1.0, {3: (1.0,) * 12}, draft_s=c.sampled_s, union=False)
    assert pick(ctrl, 6, ngram=3) == Choice(None, 6)  # a sure chain: alone, never joined
    both = Controller(MENU, c, 1.0, {3: geometric_tail(3.0)})
    for _ in range(5):  # chains that match 4 tokens where the head's trees matched none
        both.observe_chain(3, 4, 6, tree=0)
    assert pick(both, 6, ngram=3).chain and pick(both, 6, ngram=3).budget is not None  # greedy: the union
    cheap = Controller(SAMPLED_MENU, c, 2.0, {}, draft_s=c.sampled_s, union=False)
    assert cheap.choose(0, 100) == Choice(TreeBudget(2, 3, 6), False)  # priced by the sampled table and costs
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    with pytest.raises(ValueError, match="children='sample'"):  # a top-k drafter cannot serve a sampled menu
        AdaptiveDrafter(drafter_for(model, make_head(model, seed=3), True), MENU, c, 0, sampled=SAMPLED_MENU)


def test_lazy_head_catch_up_equals_following_every_step(tiny, trained):
    """After vanilla steps the head reads the whole stretch in one forward: same drafts as following."""
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)
    eager = drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8)
    want, _ = run(target, eager, PROMPTS[1], SamplingParams(), 30)
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the controller mixes vanilla steps and trees
        lazy = AdaptiveDrafter(drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU, costs(slope), 0)
        lazy_trees = []
        orig = lazy.eagle.drafting

        def spy(ctx, budget=None, orig=orig, lazy_trees=lazy_trees):
            t = yield from orig(ctx, budget)
            lazy_trees.append((len(ctx.tokens), t.tokens.tolist()))
            return t

        lazy.eagle.drafting = spy
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
    c = measure_costs(LeanRunner(tiny), eagle, MENU, 6, ctx_len=64)
    assert c.follow_s == pytest.approx(0.002) and c.catch_row_s == pytest.approx(0.001), (c.follow_s, c.catch_row_s)
    assert Costs.from_json(c.to_json()).catch_row_s == pytest.approx(c.catch_row_s, abs=1e-7)


def test_costs_are_measured_once_per_key_and_on_request(tiny, trained, tmp_path, monkeypatch, request):
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
    c1, path, fresh = load_costs(target, eagle, "h", MENU, 6)
    assert fresh.startswith("measured at load in ") and path.is_file() and len(calls) == 1
    assert set(c1.draft_s) == {B4, B8} and c1.target(1) > 0 and c1.target(33) >= c1.target(1)
    assert c1.ctx > 0 and c1.attend_s >= 0  # the context the sizes were timed at, and the attention slope
    c2, path2, fresh = load_costs(target, eagle, "h", MENU, 6)
    assert fresh == "cached" and path2 == path and c2.to_json() == c1.to_json() and len(calls) == 1
    load_costs(target, eagle, "h", MENU, 6, recalibrate=True)
    assert len(calls) == 2
    # a re-measure while another process is busy serves its command only: the stored costs stay
    stored = path.read_text()
    monkeypatch.setattr(costs_mod.ContentionMeter, "result", lambda self: {"other_cpu_frac": 0.6})
    c3, _, fresh = load_costs(target, eagle, "h", MENU, 6, recalibrate=True)
    assert "not stored: other processes used 60%" in fresh and len(calls) == 3 and path.read_text() == stored
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.set_num_threads(1)
    try:  # another thread count is another key
        _, path3, fresh = load_costs(target, eagle, "h", MENU, 6)
    finally:
        torch.set_num_threads(2)
    assert fresh != "cached" and path3 != path and len(calls) == 4
    path.write_text("{ not json")  # a damaged entry is measured again
    _, _, fresh = load_costs(target, eagle, "h", MENU, 6)
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
    overall = clock.seen / clock.priced
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
    assert 1 / one.drift <= one.seen / one.priced and one.drifted
    drafting = StepClock(min_steps=10)
    for _ in range(40):
        drafting.observe(1.0, 1.0, rows=3)
        drafting.observe_draft(0.07, 0.05)
    assert drafting.drifted and drafting.draft_factor() == pytest.approx(1.4)
    c = costs(0.1).rescaled(drafting.factors(), drafting.draft_factor())
    assert c.draft_s[B4] == pytest.approx(0.07) and c.target(3) == pytest.approx(1.2)


def test_costs_follow_the_forwards_between_requests_without_a_measurement(tiny, trained, monkeypatch, tmp_path):
    """Costs priced far off the observed forwards (as if cached on an idle machine, then another process
    made wide forwards dear) are rescaled to them before the next request, never within one (its text
    must not depend on timing), and no request runs a measurement: the prices come from the steps run."""
    from specdec.drafters import adaptive as adaptive_mod
    from specdec.drafters import costs as costs_mod
    from specdec.heads.io import load_head

    # scripted forwards: 1 ms for one row and 2 ms more per extra row, whatever the machine does (the real
    # timings of 1 ms forwards wander when other tests share the 2 cores)
    observe = StepClock.observe
    monkeypatch.setattr(StepClock, "observe", lambda self, seconds, priced, rows=1: observe(
        self, 1e-3 * (1 + 2.0 * (rows - 1)), priced, rows))
    measured = []
    for name in ("measure_costs", "measure_plain_costs", "forward_costs"):
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
    d.cache = tmp_path / "costs.json"  # learned prices go back to the cache file, when no other load ran
    costs_mod.write_cost_file(d.cache, {"k": 1}, costs=d.costs.to_json())
    monkeypatch.setattr(adaptive_mod.ContentionMeter, "result", lambda self: {"other_cpu_frac": 0.01})
    got, after = run(target, d, PROMPTS[0], SamplingParams(), 40)
    # priced as they ran (steep), wide trees no longer pay: smaller drafts, the same text
    assert got == want and d.relearned == 1 and after.costs == "given, then learned online (1x)"
    stored = json.loads(d.cache.read_text())
    assert stored["key"] == {"k": 1} and Costs.from_json(stored["costs"]).to_json() == d.costs.to_json()
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
    from specdec.drafters.clock import CatchUp
    from specdec.heads.io import load_head

    head = load_head(str(trained[1] / "head"), hidden_size=64, vocab_size=97)
    target = LeanRunner(tiny)

    def drive(slope, prompt):
        d = AdaptiveDrafter(drafter_for(tiny, head, True, depth=3, topk=3, tree_size=8), MENU, costs(slope), 0,
                            clock=StepClock())
        wanted, observed = [], []
        orig = d.eagle.drafting

        def spy(ctx, budget=None):
            extra = d.catch.extra_rows(d.eagle.pending)
            price = d.ctrl.draft_s[budget] + d.costs.follow_s + d.catch.price(extra)
            wanted.append((d.eagle.unread_steps, extra, price))
            return (yield from orig(ctx, budget))

        d.eagle.drafting = spy
        d.clock.observe_draft = lambda seconds, priced: observed.append(priced)
        run(target, d, prompt, SamplingParams(), 40)
        assert observed == [p for _, e, p in wanted if e <= CatchUp.PRICED_ROWS] and all(p > 0 for p in observed)
        return wanted

    counted = uncounted = False
    for slope in (0.12, 0.14, 0.17, 0.2, 0.25):  # costs at which the controller mixes vanilla steps and trees
        counted |= any(b > 1 and 0 < e <= CatchUp.PRICED_ROWS for b, e, _ in drive(slope, PROMPTS[1]))
        uncounted |= any(e > CatchUp.PRICED_ROWS for _, e, _ in drive(slope, PROMPTS[3]))  # the first tree reads 28
        if counted and uncounted:
            break
    assert counted and uncounted
