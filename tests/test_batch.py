"""Continuous batching (batch.py): every sequence of a batch emits what it emits decoded alone, whoever
joins or leaves meanwhile; sampled sequences follow the target's distribution."""

import numpy as np
import pytest
import torch

from specdec.batch import Batch
from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.union import UnionDrafter
from specdec.engine import Stats
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.target.lean import LeanRunner
from specdec.tree import DraftTree
from tests.helpers import SMALL_V, chi2_pvalue, drafter_for, exact_first3, flat_tiny, make_head, run, tiny_model

# (prompt, max_new_tokens): mixed lengths, so sequences leave at different steps and others join
REQUESTS = [([1, 2, 3], 24), ([5, 17, 33, 2, 9, 41, 60, 3], 6), ([88], 31), (list(range(10, 40)), 12),
            ([4, 5, 6, 4, 5, 6, 4, 5, 6, 4], 20), ([7, 8, 7, 8, 7], 3), ([50, 51, 52, 53], 17)]
EOS = {96}


def drive(batch: Batch, requests, params, max_batch: int) -> list[list[int]]:
    """Decode every request, at most max_batch at a time: a queued request joins as soon as one leaves
    (between steps), and one more joins after the first step even when that leaves the batch full."""
    out = [[] for _ in requests]
    stats = [Stats() for _ in requests]
    owner: dict = {}
    queue = list(range(len(requests)))

    def admit(limit):
        while queue and len(batch.active) < limit:
            i = queue.pop(0)
            p = params[i] if isinstance(params, list) else params
            seq, first = batch.join(requests[i][0], p, requests[i][1], stats[i])
            owner[seq] = i
            out[i] += first

    admit(max_batch - 1)
    while batch.active or queue:
        for seq, new in batch.step():
            assert not isinstance(new, Exception), new
            out[owner[seq]] += new
        admit(max_batch)
    return out, stats


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


def drafters(model) -> dict[str, Drafter]:
    return {"vanilla": NoDrafter(), "pld": PromptLookupDrafter(chain_len=4),
            "eagle2": drafter_for(model, make_head(model, seed=1), dynamic=True),
            "eagle+pld": UnionDrafter(drafter_for(model, make_head(model, seed=1), dynamic=False),
                                      PromptLookupDrafter(chain_len=3))}


@pytest.mark.parametrize("method", ["vanilla", "pld", "eagle2", "eagle+pld"])
def test_greedy_batch_equals_each_request_alone(model, method):
    runner = LeanRunner(model, exact=True)
    assert runner.exact_rows > 0  # packed forwards (else each sequence runs alone)
    drafter = drafters(model)[method]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS) for p, n in REQUESTS]
    got, stats = drive(Batch(runner, drafter, EOS), REQUESTS, SamplingParams(), max_batch=4)
    for (want, want_stats), g, s in zip(alone, got, stats):
        assert g == want
        assert s.accept_lengths == want_stats.accept_lengths and s.tree_sizes == want_stats.tree_sizes
    if method != "vanilla":
        assert any(sum(s.accept_lengths) > len(s.accept_lengths) for s in stats)  # drafts were accepted


def test_packed_forward_splits_past_the_exact_rows(model):
    """More rows than exact_rows in one step: forwards of at most exact_rows rows, the same tokens."""
    runner = LeanRunner(model, exact=True)
    runner.exact_rows = 6  # a budget the 4-row chains of 4 sequences overflow
    drafter = PromptLookupDrafter(chain_len=4)
    reqs = REQUESTS[:5]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS)[0] for p, n in reqs]
    got, _ = drive(Batch(runner, drafter, EOS), reqs, SamplingParams(), max_batch=4)
    assert got == alone


def test_a_failing_sequence_leaves_alone(model):
    class Breaks(NoDrafter):
        def fork(self):
            return Breaks()

        def propose(self, ctx):
            if ctx.prompt_len == 1 and len(ctx.tokens) > 3:
                raise RuntimeError("drafter broke")
            return DraftTree.empty()

    runner = LeanRunner(model, exact=True)
    batch = Batch(runner, Breaks(), EOS)
    a, _ = batch.join([88], SamplingParams(), 10)
    b, first = batch.join([1, 2, 3], SamplingParams(), 10)
    out, errors = list(first), []
    while batch.active:
        for seq, new in batch.step():
            if isinstance(new, Exception):
                assert seq is a
                errors.append(str(new))
            elif seq is b:
                out += new
    assert errors == ["drafter broke"]
    assert out == run(runner, NoDrafter(), [1, 2, 3], SamplingParams(), 10, EOS)[0]


def test_a_drafter_that_cannot_fork_is_refused_in_one_line(model):
    class Solo(NoDrafter):
        name = "solo"

        def fork(self):
            return None

    with pytest.raises(SpecdecError, match="drafter 'solo' cannot decode several sequences at once"):
        Batch(LeanRunner(model), Solo(), EOS)


@pytest.mark.slow
def test_sampled_batch_follows_the_target_distribution():
    """Sequences of two sampling settings (and a greedy one) in one batch, drafted by an EAGLE-2 head with
    sampled children: each setting's first 3 tokens follow the target's exact joint."""
    model = flat_tiny()
    runner = LeanRunner(model, exact=True)
    drafter = drafter_for(model, make_head(model, seed=3), dynamic=True, depth=3, topk=2, tree_size=4,
                          children="sample")
    settings = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8)]
    prompts = [[1, 3, 0, 2, 1], [2, 2, 4, 0]]
    n = 300
    reqs, params = [], []
    for i in range(n):
        for k in range(2):
            reqs.append((prompts[k], 6 if i % 2 else 4))  # lengths differ: sequences join mid-decode
            params.append(settings[k])
    reqs.append(([1, 2, 3], 8))
    params.append(SamplingParams())
    torch.manual_seed(0)
    got, _ = drive(Batch(runner, drafter, set()), reqs, params, max_batch=4)
    for k in range(2):
        counts = np.zeros(SMALL_V ** 3)
        for t in got[k:2 * n:2]:
            counts[t[0] * SMALL_V ** 2 + t[1] * SMALL_V + t[2]] += 1
        assert chi2_pvalue(counts, exact_first3(model, prompts[k], settings[k])) > 1e-3
