"""Batched drafting: a batch steps every sequence's draft together, the draft models' and heads' forwards of
all sequences at one depth packed into one; each draft, and so each answer, is exactly what it is alone."""

import pytest
import torch

from specdec.batch import Batch
from specdec.drafters.adaptive import AdaptiveDrafter
from specdec.drafters.auto import draft_menu
from specdec.drafters.base import TreeDrafter, alone, propose_many
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.forwards import HeadForward
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.union import UnionDrafter
from specdec.engine import Sequence
from specdec.heads.runner import runner_for
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import NodeSlots, TreeBudget
from tests.helpers import drafter_for, make_head, make_head3, noisy_copy, run, tiny_model
from tests.test_batch import B4, B8, EOS, REQUESTS, drive, unit_costs

V = 97
DRAFT_IDS = list(range(0, V, 3))  # a reduced draft vocabulary: the rest comes from the request (score_also)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


def draft_runner(model, reduced=False):
    runner = LeanRunner(noisy_copy(model, 0.1), exact=True)
    if reduced:
        runner.restrict_head(torch.tensor(DRAFT_IDS))
    return runner


def head_runner(model, variant):
    emb, lm = model.get_input_embeddings().weight, model.lm_head.weight
    if variant == "eagle3":
        return runner_for(make_head3(model, seed=1), emb, lm)
    vocab = list(range(0, V, 2)) if variant == "fspad" else None
    return runner_for(make_head(model, seed=1, variant=variant, draft_vocab=vocab), emb, lm)


def make_drafter(model, method):
    if method == "sps":
        return DraftModelDrafter(draft_runner(model), V, chain_len=4)
    if method == "sps-reduced":  # each fork's LM head scores its own request's ids too
        return DraftModelDrafter(draft_runner(model, reduced=True), V, chain_len=3)
    if method == "sps-tree":
        return DraftModelDrafter(draft_runner(model, reduced=True), V, tree=TreeBudget(3, 3, 6))
    if method == "eagle2":
        return drafter_for(model, make_head(model, seed=1), dynamic=True, depth=4, topk=3, tree_size=8)
    if method in ("fspad", "eagle3"):
        return EagleDrafter(head_runner(model, method), TreeBudget(3, 3, 7))
    if method == "eagle+pld":
        return UnionDrafter(drafter_for(model, make_head(model, seed=1), dynamic=False), PromptLookupDrafter(3))
    if method == "auto":
        menu = [(B4, 0.9), (B8, 1.3)]
        head = drafter_for(model, make_head(model, seed=1), True, depth=3, topk=3, tree_size=8)
        return AdaptiveDrafter(unit_costs(0.1, menu), head, menu, PromptLookupDrafter(chain_len=4))
    if method == "auto-headless+sps":
        return AdaptiveDrafter(unit_costs(0.05, draft_menu()), DraftModelDrafter(draft_runner(model), V), draft_menu(),
                               NgramDrafter(8, 2))
    raise ValueError(method)


def model_layers(drafter):
    """The first layer of the model a drafter runs (shared by all its forks)."""
    inner = getattr(drafter, "model", None) or getattr(drafter, "members", [drafter])[0]
    return inner.runner.layers[0]


def count_forwards(drafter) -> list:
    """Every forward of the drafter's model, its forks' too: one per call of its first layer's projection."""
    layer, calls = model_layers(drafter), []
    project = layer.project
    layer.project = lambda h: calls.append(h.shape[1]) or project(h)
    return calls


def seeded(i):
    return SamplingParams(0.8, top_k=20, seed=100 + i)


# ---- answers: a batch of sequences joining and leaving, each as alone ----

@pytest.mark.parametrize("method", ["sps", "sps-reduced", "sps-tree", "eagle2", "fspad", "eagle3", "auto",
                                    "auto-headless+sps"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_batch_with_packed_drafting_answers_each_request_as_alone(model, method, sampling):
    """Sequences join and leave mid-decode; drafts run packed: every answer is its answer alone (at T > 0
    with seeds, the same sampled text), and for the fixed-budget drafters the same drafts and acceptances."""
    runner = LeanRunner(model, exact=True)
    drafter = make_drafter(model, method)
    params = [SamplingParams() if sampling == "greedy" else seeded(i) for i in range(len(REQUESTS))]
    calls = count_forwards(drafter)
    alone_ = [run(runner, drafter, p, params[i], n, EOS) for i, (p, n) in enumerate(REQUESTS)]
    by_one = len(calls)
    batch = Batch(runner, drafter, EOS)
    steps, step = [], batch.step

    def counted():
        out = step()
        steps.append((batch.draft_forwards, len(calls)))
        return out

    batch.step = counted
    got, stats = drive(batch, REQUESTS, params, max_batch=4)
    assert got == [want for want, _ in alone_]
    if not method.startswith("auto"):  # auto's choices follow timings, the others' drafts are fixed
        for (_, want), s in zip(alone_, stats):
            assert s.accept_lengths == want.accept_lengths and s.tree_sizes == want.tree_sizes
    if sampling == "greedy" or not method.startswith("auto"):  # sampled auto rarely drafts on a random head
        assert any(sum(s.accept_lengths) > len(s.accept_lengths) for s in stats)  # drafts were accepted
    # the model ran exactly the packed forwards counted, fewer than the sequences' drafts would alone
    ran = [b - a for (_, a), (_, b) in zip([(0, by_one)] + steps, steps)]
    assert [n for n, _ in steps] == ran  # each packed forward is one forward
    if not method.startswith("auto"):  # the same drafts as alone, in fewer forwards
        assert 0 < sum(ran) < by_one


def test_three_sequences_drafting_depth_d_run_d_packed_draft_forwards(model):
    d = 4
    drafter = DraftModelDrafter(draft_runner(model), V, chain_len=d)
    calls = count_forwards(drafter)
    batch = Batch(LeanRunner(model, exact=True), drafter, set())
    for p, _ in REQUESTS[:3]:
        batch.join(p, SamplingParams(), 40)
    while batch.joining:
        batch.step()
    for _ in range(3):
        before = len(calls)
        out = batch.step()
        assert len(out) == 3 and all(len(batch.active[i].stats.tree_sizes) for i in range(3))
        assert all(s.stats.tree_sizes[-1] == d for s in batch.active)  # all three drafted d tokens
        assert batch.draft_forwards == d == len(calls) - before  # the catch-up and d - 1 chain steps, packed


# ---- drafts: the packed draft is the draft alone, forward by forward ----

def recorded(drafting, log):
    """The drafting, each output it is sent appended to log."""
    try:
        fwd = next(drafting)
        while True:
            out = yield fwd
            log.append(out)
            fwd = drafting.send(out)
    except StopIteration as done:
        return done.value


def tensors(out):
    if isinstance(out, tuple):
        return list(out)
    return [out.logits, out.features, out.aux]


def same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(tensors(a), tensors(b)))


@pytest.mark.parametrize("method", ["sps", "sps-reduced", "sps-tree", "eagle2", "fspad", "eagle3", "eagle+pld"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_packed_draft_equals_each_draft_alone_at_every_depth(model, method, sampling):
    """Two copies of three sequences decode step by step: one drafts alone, one packed (propose_many). At
    every step and tree depth the packed forwards give each draft exactly its outputs alone, so the
    trees are the same (tokens, parents, scores, q)."""
    runner = LeanRunner(model, exact=True)
    template = make_drafter(model, method)
    prompts = [REQUESTS[0][0], REQUESTS[1][0], REQUESTS[3][0]]
    copies = []
    for _ in range(2):
        seqs = [Sequence(runner.fork(), template.fork(), p, SamplingParams() if sampling == "greedy" else seeded(i),
                         12 + 3 * i, EOS, Stats()) for i, p in enumerate(prompts)]
        for s in seqs:
            s.prefill()
        copies.append(seqs)
    budgets = [None, TreeBudget(1, 3, 3), TreeBudget(2, 2, 4), TreeBudget(5, 2, 9)] \
        if isinstance(template, TreeDrafter) else [None]
    packed_rounds = 0
    for step in range(12):
        live = [i for i, s in enumerate(copies[0]) if not s.done]
        if not live:
            break
        budget = budgets[step % len(budgets)]  # each depth in turn
        logs = [[[] for _ in live] for _ in copies]
        trees = []
        for c, seqs in enumerate(copies):
            draftings = []
            for k, i in enumerate(live):
                seq = seqs[i]
                gen = seq.draft()
                if budget is not None and seq.ctx.max_nodes > 0:  # this call's depth
                    gen = seq.drafter.drafting(seq.ctx, budget)
                draftings.append(recorded(gen, logs[c][k]))
            if c == 0:
                trees.append([alone(g) for g in draftings])
            else:
                got, forwards = propose_many(draftings)
                trees.append(got)
                packed_rounds += forwards
                assert forwards == max(len(log) for log in logs[c])  # one packed forward per depth
        for k in range(len(live)):
            a, b = trees[0][k], trees[1][k]
            assert len(logs[0][k]) == len(logs[1][k]) and all(map(same, logs[0][k], logs[1][k]))
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            assert (a.scores is None and b.scores is None) or torch.equal(a.scores, b.scores)
            assert (a.draft_probs is None) == (b.draft_probs is None)
            assert a.draft_probs is None or torch.equal(a.draft_probs, b.draft_probs)
        news = [[], []]
        for c, seqs in enumerate(copies):
            for k, i in enumerate(live):
                seq = seqs[i]
                rows = seq.rows(trees[c][k], 0.0)
                news[c].append(seq.apply(seq.runner.forward(*rows, aux_layers=seq.aux)))
        assert news[0] == news[1]
    assert packed_rounds > 0


# ---- the head runner's packed forward ----

@pytest.mark.parametrize("variant", ["eagle", "fspad", "pad", "eagle3"])
@pytest.mark.parametrize("feature", [True, False])
def test_head_runner_packed_forward_gives_each_sequence_its_own_forward(model, variant, feature):
    """Three forks of a head, each with a cache of its own length: their rows in one packed forward get
    exactly (torch.equal) the outputs, LM head logits and cache rows of each fork's forward alone."""
    template = head_runner(model, variant)
    assert template.exact_rows > 0  # packed (else each part runs alone)
    g = torch.Generator().manual_seed(0)
    H = template.hidden_size
    vocab = template.d2t.numel() if template.d2t is not None else V
    alone_forks = [template.fork() for _ in range(3)]
    packed_forks = [template.fork() for _ in range(3)]
    # committed rows (a prompt read at the first draft): chains after each cache
    prefixes = [7, 2, 12]
    parts = []
    for n in prefixes:
        parts.append((torch.randint(0, V, (n,), generator=g), torch.randn(n, H, generator=g)))
    want = [f.forward(t, x) for f, (t, x) in zip(alone_forks, parts)]
    got = template.forward_many([(f, t, x, None, None) for f, (t, x) in zip(packed_forks, parts)])
    for a, b in zip(want, got):
        assert same(a, b)
    for f, n in zip(alone_forks + packed_forks, prefixes * 2):
        f.commit(range(n))
    # a draft depth: tree rows of each sequence (positions, masks over its committed rows and earlier nodes)
    fwds = {True: [], False: []}
    for forks, key in ((alone_forks, False), (packed_forks, True)):
        gen = torch.Generator().manual_seed(1)
        for f, rows in zip(forks, (1, 4, 3)):
            par = [-1] * rows
            mask = NodeSlots().mask(list(range(rows)), par, f.length)
            pos = torch.full((rows,), f.length)
            fwds[key].append(HeadForward(f, torch.randint(0, vocab, (rows,), generator=gen),
                                         torch.randn(rows, H, generator=gen), pos, mask, draft=True, feature=feature))
    want = [HeadForward.run_many([f])[0] for f in fwds[False]]
    got = HeadForward.run_many(fwds[True])
    assert len({f.pack for f in fwds[True]}) == 1  # the same kind of forward: they pack
    for a, b in zip(want, got):
        assert same(a, b) and a[2] is not None
        assert (a[0] is None) == (variant in ("pad", "fspad") and not feature)  # PAD skips f̂ at a last depth
    for a, b in zip(alone_forks, packed_forks):
        n = a.length + a.n_pending
        assert n == b.length + b.n_pending
        assert torch.equal(a.cache.k[..., :n, :], b.cache.k[..., :n, :])
        assert torch.equal(a.cache.v[..., :n, :], b.cache.v[..., :n, :])


@pytest.mark.parametrize("head", ["reduced", "reduced+request", "whole", "wider than the target"])
def test_a_greedy_chain_takes_the_argmax_over_the_target_ids(model, head):
    """A greedy chain's token comes from the draft's own columns without spreading them over the target's
    vocabulary: the same id as the argmax of the spread logits (ties aside), also where the draft scores
    ids the target lacks."""
    target_vocab = V - 7 if head == "wider than the target" else V
    d = DraftModelDrafter(draft_runner(model, reduced=head.startswith("reduced")), target_vocab, chain_len=3)
    if head == "reduced+request":
        d.runner.score_also([1, 2, 4, 5])
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        raw = torch.randn(d.runner.vocab_size, generator=g)
        if head == "wider than the target" and i % 2:
            raw[target_vocab:] += 10.0  # the draft's best ids are ones the target has not
        assert d._argmax(raw) == int(d._pad(raw).argmax())
