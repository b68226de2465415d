"""Lookahead decoding: the Jacobi window rides in the verify forward without touching what is verified,
and whatever it guesses, the output is the target's."""

import pytest
import torch

from specdec.drafters import registry
from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.lookahead import MAX_ROWS, LookaheadDrafter
from specdec.engine import Sequence
from specdec.errors import SpecdecError
from specdec.runtime.lean import EXACT_ROWS, LeanRunner
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import DraftTree
from tests.helpers import chi2_pvalue, exact_first3, flat_tiny, greedy_taus, run, sample_first3, tiny_model


class GarbageWindow(LookaheadDrafter):
    """Its window and pool follow random logits, not the target's: every guess is noise."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.noise = torch.Generator().manual_seed(7)

    def side_logits(self, logits: torch.Tensor) -> None:
        super().side_logits(torch.randn(logits.shape, generator=self.noise))


class Recorder(LookaheadDrafter):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.got: list[torch.Tensor] = []

    def side_logits(self, logits: torch.Tensor) -> None:
        self.got.append(logits.clone())
        super().side_logits(logits)


def test_greedy_equals_vanilla_and_pool_drafts_get_accepted(family):
    target = LeanRunner(tiny_model(family))
    taus = greedy_taus(target, LookaheadDrafter())
    assert max(taus) > 1.2  # random models loop: the window's n-grams get accepted


def test_a_repetitive_prompt_is_drafted_from_the_pool():
    target = LeanRunner(tiny_model("llama"))
    drafter = LookaheadDrafter(window=4, ngram_size=4, guesses=3)
    want, _ = run(target, NoDrafter(), [5, 6, 7, 8] * 6, SamplingParams(), 48)
    got, stats = run(target, drafter, [5, 6, 7, 8] * 6, SamplingParams(), 48)
    assert got == want
    assert max(stats.tree_sizes) > 0 and max(stats.accept_lengths) > 1
    assert all(len(rest) == 3 for grams in drafter.pool.values() for rest in grams)  # N - 1 after the key
    assert all(len(grams) <= 3 for grams in drafter.pool.values())  # G per first token


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.9, top_k=20, top_p=0.95, seed=3)],
                         ids=["greedy", "seeded-T0.9"])
def test_a_garbage_window_never_changes_the_output(params):
    """Window tokens reach the output only through the verifier: noise in the window and pool drafts
    rejected guesses, and the tokens are vanilla's (a seeded request's draws do not depend on the draft)."""
    target = LeanRunner(tiny_model("llama"))
    prompt = [3, 9, 27, 81, 3, 9, 27]
    want, _ = run(target, NoDrafter(), prompt, params, 40)
    got, stats = run(target, GarbageWindow(window=6, ngram_size=3, guesses=4), prompt, params, 40)
    assert got == want
    assert sum(stats.tree_sizes) > 0  # the garbage was drafted and verified


def test_verified_rows_are_bit_identical_with_and_without_the_window():
    """The side rows change no bit of the root's and the tree's logits and features (the runner keeps
    rows exact up to EXACT_ROWS), and each side row computes its own diagonal sequence."""
    target = LeanRunner(tiny_model("llama"), exact=True)
    assert target.exact_rows == EXACT_ROWS == MAX_ROWS
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    drafter = Recorder(window=4, ngram_size=4, guesses=2)
    tree = DraftTree(torch.tensor([16, 23, 17, 42]), torch.tensor([-1, 0, -1, 1]))
    n = 1 + len(tree)
    outs = []
    for d in (NoDrafter(), drafter):
        seq = Sequence(target, d, prompt, SamplingParams(), 10, set(), Stats())
        (root,) = seq.prefill()
        d.propose = lambda ctx, budget=None: tree  # the same tree with and without the window
        if d is drafter:
            drafter.levels = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
        out = target.forward(*seq.plan())
        assert target.n_pending == n + (12 if d is drafter else 0)
        outs.append((out.logits[:n].clone(), out.features[:n].clone()))
        seq.apply(out)
        assert target.length == len(seq.ctx.tokens) - 1  # every token but the new root: no side row kept
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    (side,) = drafter.got
    assert side.shape[0] == 12
    # row (level l, column j) sees the root, level 0's columns 0..j, then its column's levels 1..l
    levels = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    for lvl in range(3):
        for col in range(4):
            seq = prompt + [root] + levels[0][: col + 1] + [levels[k][col] for k in range(1, lvl + 1)]
            target.reset()
            want = target.forward(torch.tensor(seq)).logits[-1]
            torch.testing.assert_close(side[lvl * 4 + col], want, atol=1e-4, rtol=1e-4)


def test_the_pool_starts_with_the_prompts_ngrams_latest_first():
    ctx = DecodeContext([5, 6, 7, 5, 6, 8, 5], SamplingParams(), None, 4)
    drafter = LookaheadDrafter(window=2, ngram_size=3, guesses=2)
    drafter.begin(ctx)
    assert {k: list(v) for k, v in drafter.pool.items()} == {5: [(6, 7), (6, 8)], 6: [(7, 5), (8, 5)], 7: [(5, 6)]}
    tree = drafter.propose(ctx)  # after 5: (6, 8) is the latest, (6, 7) the other guess
    assert tree.tokens.tolist() == [6, 8, 7] and tree.parents.tolist() == [-1, 0, 0]
    one = LookaheadDrafter(window=2, ngram_size=3, guesses=1)
    one.begin(ctx)
    assert one.propose(ctx).tokens.tolist() == [6, 8]
    off = LookaheadDrafter(window=2, ngram_size=3, guesses=2, pool_from_prompt=False)
    off.begin(ctx)
    assert not off.pool and len(off.propose(ctx)) == 0


def test_the_window_shifts_and_fills_the_pool():
    drafter = LookaheadDrafter(window=2, ngram_size=3, guesses=2, pool_from_prompt=False)
    ctx = DecodeContext([1, 2, 3], SamplingParams(), None, 2)
    drafter.begin(ctx)
    drafter.levels = [[10, 11]]
    logits = torch.zeros(2, 50)
    logits[0, 20], logits[1, 21] = 1, 1
    drafter.side_rows(ctx)
    drafter.side_logits(logits)  # filling: a second level, no n-gram yet
    assert drafter.levels == [[10, 11], [20, 21]] and not drafter.pool
    logits = torch.zeros(4, 50)
    logits[2, 30], logits[3, 31] = 1, 1
    drafter.side_rows(ctx)
    drafter.side_logits(logits)
    assert drafter.levels == [[20, 21], [30, 31]]
    assert drafter.pool == {10: {(20, 30): None}, 11: {(21, 31): None}}
    ctx.tokens.append(10)
    tree = drafter.propose(ctx)
    assert tree.tokens.tolist() == [20, 30] and tree.parents.tolist() == [-1, 0]


def test_rows_past_the_exact_limit_are_left_out_of_the_forward():
    target = LeanRunner(tiny_model("llama"), exact=True)
    drafter = Recorder(window=40, ngram_size=2, guesses=1)
    run(target, drafter, [1, 2, 3], SamplingParams(), 8)
    assert drafter.got  # 41 rows fit
    big = Recorder(window=70, ngram_size=2, guesses=1)  # past EXACT_ROWS: built directly, not through options
    got, _ = run(target, big, [1, 2, 3], SamplingParams(), 8)
    assert not big.got and got == run(target, NoDrafter(), [1, 2, 3], SamplingParams(), 8)[0]


@pytest.mark.parametrize("raw,needle", [
    ({"ngram_size": 1}, "ngram_size"), ({"window": 0}, "window"), ({"guesses": "x"}, "guesses"),
    ({"window": 30, "guesses": 10, "ngram_size": 3}, "at most 64"),
])
def test_bad_options_are_one_line_before_any_model(raw, needle):
    with pytest.raises(SpecdecError, match=needle) as e:
        registry.parse("lookahead", raw)
    assert "\n" not in str(e.value) and str(e.value).startswith("method 'lookahead': ") and "?" not in str(e.value)


@pytest.mark.slow
def test_sampling_matches_the_target_distribution():
    """Unseeded requests (recursive rejection over point-mass siblings; a seeded request's tokens equal
    vanilla's, test_a_garbage_window_never_changes_the_output). N = 2 so the pool drafts from the second
    forward on, inside the first three tokens."""
    model = flat_tiny()
    params = SamplingParams(0.8, top_k=3, top_p=0.9)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    counts, sizes = sample_first3(LeanRunner(model), LookaheadDrafter(window=5, ngram_size=2, guesses=3), prompt,
                                  params, coupled=False)
    assert max(sizes) >= 2
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


@pytest.mark.slow
def test_smollm2_repetitive_text_is_lossless_and_accepted(smollm2_default):
    from specdec.api import from_models

    model, tok, weights = smollm2_default
    spec, vanilla = (from_models(model, tok, m, weights=weights) for m in ("lookahead", "vanilla"))
    msgs = [{"role": "user", "content": "Count from 1 to 40, separated by commas."}]
    want = vanilla.generate(msgs, max_new_tokens=64)
    got = spec.generate(msgs, max_new_tokens=64)
    assert spec.runner.exact_rows and got.token_ids == want.token_ids
    assert got.stats.tau > 1.2
