"""`auto` without a head: the n-gram index and draft, the calibrated pricing of the draft's prefixes,
losslessness (greedy equality, chi-square at T > 0) and a choice that reads only earlier verdicts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.drafters.adaptive import DRAFT_ALPHA, DRAFT_ALPHA_SAMPLED, AdaptiveDrafter, tried
from specdec.drafters.auto import draft_menu
from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.costs import Costs
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.policy import ChainRate, Policy
from specdec.drafters.prompt_lookup import NgramIndex
from specdec.errors import SpecdecError
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.verify import Verdict, greedy_walk
from tests.helpers import (
    PROMPTS,
    chi2_pvalue,
    exact_first3,
    flat_tiny,
    noisy_copy,
    run,
    sample_first3,
    tiny_model,
)

REPEATS = [4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5]
LOOPS = 2  # the seed of a tiny model whose greedy answer to REPEATS falls into a loop: drafts get accepted


def costs(slope: float, draft: float = 0.05) -> Costs:
    """t(N) = 1 + slope * (N - 1) seconds; each draft-model chain of k tokens costs k * draft."""
    return Costs({n: 1 + slope * (n - 1) for n in (1, 2, 3, 5, 9, 13, 17, 25, 33)},
                 {b: draft * b.depth for b, _ in draft_menu()}, 0.0, 0.001)


def ctx_of(tokens: list[int]) -> DecodeContext:
    return DecodeContext(list(tokens), SamplingParams(), None, len(tokens))


# ---- the index and the n-gram draft ----

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.lists(st.integers(1, 6), min_size=1, max_size=10),
       st.integers(1, 5))
def test_ngram_index_grown_step_by_step_equals_a_scan_of_the_whole_list(tokens, grow, max_ngram):
    """Latest end and continuation counts of every n-gram, updated by new tokens only, equal a scan."""
    def scan(toks):
        ends = [{} for _ in range(max_ngram + 1)]
        counts = [{} for _ in range(max_ngram + 1)]
        for n in range(1, max_ngram + 1):
            for e in range(n, len(toks)):
                g = tuple(toks[e - n:e])
                ends[n][g] = e
                counts[n].setdefault(g, {}).setdefault(toks[e], 0)
                counts[n][g][toks[e]] += 1
        return ends, counts

    seq, index, cut = tokens[:1], None, 1
    for g in grow + [len(tokens)]:
        cut = min(len(tokens), cut + g)
        seq.extend(tokens[len(seq):cut])
        index = NgramIndex.over(index, seq, max_ngram)
        assert (index.ends, index.counts) == scan(seq)
    other = list(reversed(seq))  # another request's list: indexed afresh
    fresh = NgramIndex.over(index, other, max_ngram)
    assert fresh is not index and (fresh.ends, fresh.counts) == scan(other)


def test_ngram_draft_copies_the_longest_match_and_branches_where_counts_disagree():
    d = NgramDrafter(tree_size=8, topk=2)
    # "1 2 3 4" was followed by 5 once and by 6 once: a branch, the latest (6) first; "1 2 3" -> 4 twice
    t = d.propose(ctx_of([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3]))
    assert t.tokens.tolist()[:3] == [4, 6, 5] and t.parents.tolist()[:3] == [-1, 0, 0]
    v = t.scores.exp().tolist()
    assert v[0] == pytest.approx(2 / (2 + 2 / 3)) and v[1] == pytest.approx(v[2])  # 2 of 2, plus KAPPA / 3
    assert all(a >= b for a, b in zip(v, v[1:]))  # best first: every prefix is a tree
    # a long copy: the latest occurrence matches 20 tokens, far beyond max_ngram, so the copy is near sure
    toks = list(range(10, 40)) + list(range(10, 30))
    chain = NgramDrafter(tree_size=5, topk=2).propose(ctx_of(toks))
    assert chain.tokens.tolist() == [30, 31, 32, 33, 34] and chain.parents.tolist() == [-1, 0, 1, 2, 3]
    assert chain.scores.exp()[0] == pytest.approx(1 / (1 + 2 / 20))
    assert len(NgramDrafter().propose(ctx_of([1, 2, 3]))) == 0  # nothing repeats
    c = ctx_of(toks)
    c.max_nodes = 2
    assert len(NgramDrafter().propose(c)) == 2


def test_the_emitted_tokens_try_the_root_children_and_the_matched_nodes_children():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]))
    ch, toks = t.children(), t.tokens.tolist()
    assert tried(ch, toks, [5, 7, 8]) == ([(0, True), (1, False), (2, True), (3, True)], True)  # a leaf
    assert tried(ch, toks, [6, 1]) == ([(0, False), (1, True)], True)
    assert tried(ch, toks, [5]) == ([(0, True), (1, False)], False)  # node 2 awaits the next token
    assert tried(ch, toks, [9]) == ([(0, False), (1, False)], True)


# ---- pricing ----

def test_the_verified_prefix_is_priced_by_the_target_cost_of_its_rows():
    """Calibrated acceptance of each node + t(N): a flat t(N) verifies the whole sure draft, a steep one
    (an int8 target's t(8) ~ 2.4 t(1)) only its likely head, and a draft worth nothing is not verified."""
    gains = [0.9, 1.7, 2.3, 2.7, 2.9, 3.0, 3.05, 3.08]  # expected accepted tokens of the first m nodes
    look = costs(0.0).lookup_s
    flat = Policy([], costs(0.0)).choose(gains, 100, look=look)
    steep = Policy([], costs(0.2)).choose(gains, 100, look=look)
    assert flat.budget is None and flat.chain == 8
    assert 2 <= steep.chain <= 4
    # at best 1.05 tokens for t(2) = 1.2 against a plain step's 1 for 1: no hurdle (no head) needed
    assert Policy([], costs(0.2)).choose([0.05 * i for i in range(1, 9)], 100, look=look).vanilla
    assert Policy([], costs(0.0)).choose(gains, 3, look=look).chain == 3  # no more room


# ---- losslessness ----

def test_headless_auto_greedy_equals_vanilla_and_mixes_plain_steps_and_drafts():
    model = tiny_model("llama", seed=LOOPS)
    target = LeanRunner(model)
    sizes = set()
    for slope in (0.02, 0.15, 0.4):
        for topk in (1, 2):
            drafter = AdaptiveDrafter(costs(slope), ngram=NgramDrafter(12, topk))
            for p in PROMPTS + [REPEATS]:
                want, _ = run(target, NoDrafter(), p, SamplingParams(), 40)
                got, stats = run(target, drafter, p, SamplingParams(), 40)
                assert got == want
                sizes |= set(stats.tree_sizes)
                if p is REPEATS and slope < 0.1:
                    assert stats.tau > 1.4  # drafts were accepted
    assert 0 in sizes and len(sizes) >= 4  # plain steps and drafts of several lengths


def test_a_draft_models_chains_are_priced_by_its_learned_acceptance():
    """Chains accepted whole raise the per-token rate from its prior, and the choice moves to longer chains;
    chains rejected at once lower it, and the choice moves back to shorter ones (or none)."""
    rate, menu = ChainRate(DRAFT_ALPHA), draft_menu()
    one = menu[0][0]  # a chain of one token: its expected accepted tokens are the per-token rate
    assert rate.gains(menu) == pytest.approx(dict(menu)) and rate.gains(menu)[one] == pytest.approx(DRAFT_ALPHA)
    # a forward as dear as 5 drafted tokens, flat up to 9 rows: at the prior's 0.7 a chain of 1 pays most
    c = Costs({n: 1.0 if n <= 9 else 2.0 for n in (1, 2, 3, 5, 7, 9, 13)}, {b: 0.2 * b.depth for b, _ in menu},
              0.0, 0.0)
    p = Policy(menu, c, union=False)
    p.regain(rate.gains(menu))
    before = p.choose([], 16).budget
    for _ in range(20):
        rate.observe(4, 4)
    assert rate.gains(menu)[one] > 0.9
    gains = rate.gains(menu)
    assert all(gains[a] < gains[b] for (a, _), (b, _) in zip(menu, menu[1:]))
    p.regain(gains)
    after = p.choose([], 16).budget
    assert before is not None and after is not None and after.depth > before.depth
    for _ in range(20):
        rate.observe(0, 4)
    assert rate.gains(menu)[one] < 0.5
    p.regain(rate.gains(menu))
    last = p.choose([], 16).budget
    assert last is None or last.depth < after.depth


def chains_drafted(drafter: AdaptiveDrafter) -> list:
    """The budget of every draft-model chain the drafter asks for from now on, as a list that grows."""
    chose = []
    orig = drafter.model.drafting

    def spy(ctx, b=None):
        chose.append(b)
        return (yield from orig(ctx, b))

    drafter.model.drafting = spy
    return chose


def test_headless_auto_with_a_draft_model_is_lossless_and_uses_it():
    model = tiny_model("llama", seed=LOOPS)
    target = LeanRunner(model)
    drafter = AdaptiveDrafter(costs(0.05, draft=0.01), DraftModelDrafter(LeanRunner(noisy_copy(model, 0.1)), 97),
                              draft_menu(), NgramDrafter(8, 2))
    chose = chains_drafted(drafter)
    for p in PROMPTS + [REPEATS]:
        want, _ = run(target, NoDrafter(), p, SamplingParams(), 30)
        got, _ = run(target, drafter, p, SamplingParams(), 30)
        assert got == want
    assert chose and len({b.depth for b in chose}) >= 2  # draft-model chains of several lengths
    # chains are priced by the learned per-token rate alone: a miss lowers it once, not once more as a scale
    learned = drafter.rate.gains(drafter.menu)
    assert learned[drafter.menu[0][0]] > DRAFT_ALPHA  # a close copy of the target: accepted above the prior
    assert {b: drafter.scale.value * drafter.policy.gain[b] for b, _ in drafter.menu} == pytest.approx(learned)
    chose.clear()
    run(target, drafter, REPEATS, SamplingParams(0.8, seed=1), 30)  # sampled chains, never merged with n-grams
    assert chose and drafter.rate.prior == DRAFT_ALPHA_SAMPLED and not drafter.policy.union


def test_headless_auto_reads_a_long_context_into_the_draft_only_where_the_answer_repays_it():
    """The draft model reads a 200-token context at 0.05 s a row (10 s) before its first chain, which saves
    ~0.55 s a token at the prior: with 9 tokens left it never drafts (n-grams still may), with 59 it does;
    a short prompt's reading pays at 9. Every answer is vanilla's."""
    model = tiny_model("llama", seed=LOOPS)
    target = LeanRunner(model)
    c = costs(0.05, draft=0.01)
    c.catch_row_s = 0.05
    drafter = AdaptiveDrafter(c, DraftModelDrafter(LeanRunner(noisy_copy(model, 0.1)), 97), draft_menu(),
                              NgramDrafter(8, 2))
    chose = chains_drafted(drafter)
    long = (PROMPTS[1] * 200)[:200]
    for prompt, tokens, drafts in [(long, 10, False), (long, 60, True), (PROMPTS[1], 10, True)]:
        chose.clear()
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), tokens)
        got, _ = run(target, drafter, prompt, SamplingParams(), tokens)
        assert got == want
        assert bool(chose) == drafts, (len(prompt), tokens, chose)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)],
                         ids=["T1", "T0.8-topk3-topp0.9"])
def test_headless_auto_sampling_matches_the_target_distribution(params):
    model = flat_tiny()
    drafter = AdaptiveDrafter(costs(0.05), ngram=NgramDrafter(6, 2))
    prompt = [1, 3, 0, 2, 1, 3, 0, 2, 1, 3]
    counts, sizes = sample_first3(LeanRunner(model), drafter, prompt, params)
    assert 0 in sizes and max(sizes) >= 2  # plain steps and drafts among the first tokens
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


def test_a_step_draft_depends_only_on_earlier_verdicts():
    """Two answers that agree up to a point and then differ: every draft made before the point is the same
    in both, though the verdict of the step that crosses it differs (a choice that peeked at its own
    verdict would not be)."""
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    common = [3, 4, 1, 2, 3, 4, 5, 1, 2, 3, 4, 1]
    answers = (common + [2, 3, 4, 1, 2, 3, 9, 9], common + [7, 7, 1, 2, 3, 4, 1, 2])

    def drafts(answer):
        d = AdaptiveDrafter(costs(0.1), ngram=NgramDrafter(8, 2))
        ctx = ctx_of(prompt + answer[:1])
        d.begin(ctx)
        out = []
        while len(ctx.tokens) < len(prompt) + len(answer):
            done = len(ctx.tokens) - len(prompt)
            tree = d.propose(ctx)
            out.append((len(ctx.tokens), tree.tokens.tolist(), tree.parents.tolist()))
            path = greedy_walk(tree, lambda _, k: answer[done + k] if done + k < len(answer) else None)[0]
            new = answer[done:done + len(path) + 1]
            ctx.tokens.extend(new)
            d.accept(ctx, Verdict(path, new, new[-1]))
        return out

    a, b = drafts(answers[0]), drafts(answers[1])
    edge = len(prompt) + len(common)
    before = [s for s in a if s[0] <= edge]
    assert before == [s for s in b if s[0] <= edge] and len(before) >= 3
    assert any(len(s[1]) for s in before)  # real drafts, not only plain steps


# ---- auto resolves to it ----

def test_auto_without_a_head_runs_the_adaptive_drafter_without_a_model(tmp_path, monkeypatch):
    from specdec.api import from_models
    from specdec.drafters import registry

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_model("llama", seed=LOOPS)
    dec = from_models(model, None, "auto")
    assert isinstance(dec.drafter, AdaptiveDrafter) and dec.drafter.model is None
    assert "no head" in dec.method and dec.drafter.costs.target(1) > 0
    want, _ = run(LeanRunner(model), NoDrafter(), REPEATS, SamplingParams(), 30)
    got, stats = run(dec.runner, dec.drafter, REPEATS, SamplingParams(), 30)
    assert got == want and "no head" in stats.summary()["drafter"] and "ngram" in stats.drafter
    with_draft = from_models(model, None, "auto", draft_model=noisy_copy(model, 0.1))
    assert isinstance(with_draft.drafter.model, DraftModelDrafter) and "sps" in with_draft.drafter.name
    assert isinstance(from_models(model, None, "auto", adaptive=False).drafter, NgramDrafter)
    assert isinstance(from_models(model, None, "auto", lookup=0).drafter, NoDrafter)
    with pytest.raises(SpecdecError, match="no head"):
        from_models(model, None, "auto", depth=3)
    assert registry.get("auto").takes_draft and not registry.get("auto").needs_draft


def test_earlier_answers_supply_matches_the_request_lacks():
    d = NgramDrafter(tree_size=4, topk=1)
    first = [30, 31, 32, 33, 34, 35, 36]
    d.begin(ctx_of([1, 2]))
    d.end(first)
    c = ctx_of([7, 8, 31, 32, 33])  # 31 32 33 never occurred in this request: only in the earlier answer
    d.begin(c)
    assert d.propose(c).tokens.tolist() == [34, 35, 36]  # the separator after an answer is never drafted
    alone = NgramDrafter(tree_size=4, topk=1, history=0)
    alone.end(first)
    alone.begin(c)
    assert len(alone.propose(c)) == 0
    short = ctx_of([7, 8, 32, 33])  # a 2-gram of another answer guesses too little to draft
    d.begin(short)
    assert len(d.propose(short)) == 0
    own = ctx_of([31, 32, 33, 50, 9, 31, 32, 33])  # the request's own text wins a match of the same length
    d.begin(own)
    assert d.propose(own).tokens.tolist()[0] == 50
    with pytest.raises(SpecdecError, match="history >= 0, got .*history=-1"):
        NgramDrafter(history=-1)


def test_the_history_keeps_the_newer_half_of_its_cap_from_an_answer_start():
    from specdec.drafters.ngram import SEP, History

    h = History(3, cap=20)
    for a in range(5):
        h.add([100 * a + i for i in range(6)])  # 7 tokens with the separator
    # the 21st token: the newest 10 (304 305 SEP 400 ... 405 SEP) cut at the first separator
    assert h.tokens == [400, 401, 402, 403, 404, 405, SEP]
    assert h.following((400, 401, 402)) == ({403: 1}, 403) and h.following((300, 301, 302)) is None


def test_a_decode_teaches_the_next_request_and_batch_forks_share_what_they_learn():
    model = tiny_model("llama", seed=LOOPS)
    target = LeanRunner(model, exact=True)
    drafter = NgramDrafter(8, 1)
    from specdec.engine import decode
    from specdec.stats import Stats

    stats = Stats()
    untaught = [t for s in decode(target, drafter, REPEATS, SamplingParams(), 8, set(), stats, learn=False) for t in s]
    assert len(untaught) == 8 and drafter.history.tokens == []  # the benchmark's warm-up teaches nothing
    answer, _ = run(target, drafter, REPEATS, SamplingParams(), 24)
    assert drafter.history.tokens[:len(answer)] == answer  # decode() ended the request with its answer
    fork = drafter.fork()
    assert fork.history is drafter.history
    from specdec.batch import Batch

    batch = Batch(target, drafter, set())
    seq = batch.join([9, 10, 11], SamplingParams(), 5)
    while len(batch):
        batch.step()
    assert drafter.history.tokens[len(answer) + 1:-1] == seq.ctx.tokens[3:]  # a sequence that left taught it
