"""End-to-end losslessness of the engine on random tiny models (all families, both runners)."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import SpecdecError
from specdec.runtime.hf import HFRunner
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from tests.helpers import (
    PROMPTS,
    SMALL_V,
    chi2_pvalue,
    exact_first3,
    flat_tiny,
    noisy_copy,
    run,
    sample_first3,
    tiny_model,
    word_tokenizer,
)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_vanilla_greedy_equals_hf_generate(family, backend):
    model = tiny_model(family)
    runner = (LeanRunner if backend == "lean" else HFRunner)(model)
    for prompt in PROMPTS:
        ours, stats = run(runner, NoDrafter(), prompt, SamplingParams(), 24)
        assert ours == hf_greedy(model, prompt, 24)
        assert stats.target_forwards == 23 and stats.tau == 1.0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculative_greedy_equals_vanilla(family, shape):
    model = tiny_model(family)
    target, draft = LeanRunner(model), LeanRunner(noisy_copy(model))
    drafter = DraftModelDrafter(draft, target.vocab_size, 4, TreeBudget(4, 3, 10) if shape == "tree" else None)
    taus = []
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 40)
        got, stats = run(target, drafter, prompt, SamplingParams(), 40)
        assert got == want
        assert stats.new_tokens == 40 and sum(stats.accept_lengths) + 1 >= 40
        taus.append(stats.tau)
    assert np.mean(taus) > 1.3  # the noisy copy does get tokens accepted: the tree paths are exercised


def test_draft_with_fewer_vocab_rows_is_padded():
    model = tiny_model("llama")
    small = tiny_model("llama", vocab_size=90)
    drafter = DraftModelDrafter(LeanRunner(small), 97, chain_len=3)
    want, _ = run(LeanRunner(model), NoDrafter(), PROMPTS[1], SamplingParams(), 20)
    got, _ = run(LeanRunner(model), drafter, PROMPTS[1], SamplingParams(), 20)
    assert got == want


class Recording(DraftModelDrafter):
    """A draft-model drafter that keeps every token it drafts."""

    drafted: set

    def drafting(self, ctx, budget=None):
        tree = yield from super().drafting(ctx, budget)
        self.drafted = getattr(self, "drafted", set()) | set(tree.tokens.tolist())
        return tree


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_draft_over_a_reduced_vocabulary_gives_vanilla_tokens(shape):
    model = tiny_model("llama")
    draft = LeanRunner(noisy_copy(model))
    x = torch.tensor(PROMPTS[0])
    full = draft.forward(x).logits
    draft.rollback()
    ids = torch.arange(0, model.config.vocab_size, 3)
    assert draft.restrict_head(ids) and draft.vocab_size == ids.numel()
    sub = draft.forward(x).logits
    draft.reset()
    # each output is its own dot product: the kept columns are bit for bit what the whole head gives
    assert torch.equal(sub, full[:, ids]) if draft.decode_kernel == "stream" else torch.allclose(sub, full[:, ids])
    head = draft.lm_head.with_extra([1, 4])
    grown, fresh = head.with_extra([1, 4, 7]), draft.lm_head.with_extra([1, 4, 7])  # the first only adds row 7
    assert torch.equal(grown.extra, fresh.extra) and grown.ids.tolist() == [*ids.tolist(), 1, 4, 7]
    target = LeanRunner(model)
    drafter = Recording(draft, target.vocab_size, 4, TreeBudget(4, 3, 10) if shape == "tree" else None)
    accepted, seen = 0, set()
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 40)
        got, stats = run(target, drafter, prompt, SamplingParams(), 40)
        assert got == want
        accepted += sum(stats.accept_lengths)
        seen |= set(prompt + got)
    # it drafts from the fixed set and from the request's own tokens outside it (score_also)
    assert drafter.drafted <= set(ids.tolist()) | seen and drafter.drafted - set(ids.tolist())
    assert accepted > 0


# ---- T > 0: the distribution of the first generated tokens equals vanilla sampling ----

# every pair of (sampling, shape, seeded or not) once: six runs where the whole product takes twelve
PAIRWISE = [
    (SamplingParams(1.0), "chain", True), (SamplingParams(1.0), "tree", False),
    (SamplingParams(0.8, top_k=3), "chain", False), (SamplingParams(0.8, top_k=3), "tree", True),
    (SamplingParams(1.2, top_p=0.85), "chain", True), (SamplingParams(1.2, top_p=0.85), "tree", False),
]


@pytest.mark.slow
@pytest.mark.parametrize("params,shape,coupled", PAIRWISE, ids=[
    "T1-chain-seeded", "T1-tree-unseeded", "T0.8-topk3-chain-unseeded", "T0.8-topk3-tree-seeded",
    "T1.2-topp0.85-chain-seeded", "T1.2-topp0.85-tree-unseeded"])
def test_speculative_sampling_matches_vanilla_distribution(shape, params, coupled):
    model = flat_tiny()
    target, draft = LeanRunner(model), LeanRunner(noisy_copy(model, 0.5))
    if params.top_k is None:  # and a draft over part of the vocabulary (its q is 0 elsewhere)
        draft.restrict_head(torch.tensor([0, 2, 3]))
    drafter = DraftModelDrafter(draft, SMALL_V, 3, TreeBudget(3, 2, 5) if shape == "tree" else None)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params, coupled=coupled)
    assert max(sizes) >= 3
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


def test_seeded_generation_is_reproducible():
    model = tiny_model("qwen2")
    target, draft = LeanRunner(model), LeanRunner(noisy_copy(model))
    drafter = DraftModelDrafter(draft, target.vocab_size, chain_len=3)
    p = SamplingParams(1.0, seed=11)
    a, _ = run(target, drafter, PROMPTS[0], p, 30)
    b, _ = run(target, drafter, PROMPTS[0], p, 30)
    c, _ = run(target, drafter, PROMPTS[0], SamplingParams(1.0, seed=12), 30)
    assert a == b and a != c


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=3), SamplingParams(0.8, top_k=5, seed=4),
                                    SamplingParams(1.2, top_p=0.9, seed=5)], ids=["T1", "topk", "topp"])
def test_a_seed_gives_vanilla_text_whatever_drafts(params):
    """Seeded requests sample through the coupling: the text is the target's draws, so a draft model
    chain, a draft tree and an n-gram draft all give vanilla's text for the same seed."""
    from specdec.drafters.ngram import NgramDrafter

    model = tiny_model("qwen2")
    target = LeanRunner(model)
    prompt = PROMPTS[1] * 3  # repeats: the n-gram index drafts
    want, _ = run(target, NoDrafter(), prompt, params, 40)
    for drafter in (DraftModelDrafter(LeanRunner(noisy_copy(model)), target.vocab_size, chain_len=3),
                    DraftModelDrafter(LeanRunner(noisy_copy(model)), target.vocab_size, 4, TreeBudget(3, 2, 6)),
                    NgramDrafter(8)):
        got, st = run(target, drafter, prompt, params, 40)
        assert got == want and sum(st.tree_sizes) > 0, type(drafter).__name__
    exact, _ = run(target, DraftModelDrafter(LeanRunner(copy.deepcopy(model)), target.vocab_size, chain_len=3),
                   prompt, params, 40)
    assert exact == want


# ---- stops ----

def test_eos_stops_and_is_emitted():
    model = tiny_model("llama")
    runner = LeanRunner(model)
    full, _ = run(runner, NoDrafter(), PROMPTS[1], SamplingParams(), 30)
    eos = full[7]
    first = full.index(eos)
    for drafter in (NoDrafter(), DraftModelDrafter(LeanRunner(noisy_copy(model)), 97, chain_len=4)):
        out, stats = run(runner, drafter, PROMPTS[1], SamplingParams(), 30, eos=[eos])
        assert out == full[: first + 1] and stats.finish_reason == "stop"


def test_max_new_tokens_is_exact_with_long_drafts():
    model = tiny_model("llama")
    drafter = DraftModelDrafter(LeanRunner(copy.deepcopy(model)), 97, chain_len=6)  # a perfect draft
    for n in (1, 2, 5, 13):
        out, stats = run(LeanRunner(model), drafter, PROMPTS[0], SamplingParams(), n)
        assert len(out) == n and stats.finish_reason == "length"


def test_context_limit_ends_generation_cleanly():
    model = tiny_model("llama", max_position_embeddings=24)
    for drafter in (NoDrafter(), DraftModelDrafter(LeanRunner(copy.deepcopy(model)), 97, chain_len=5)):
        out, stats = run(LeanRunner(model), drafter, PROMPTS[1], SamplingParams(), 100)
        assert len(PROMPTS[1]) + len(out) == 24 + 1  # the last token is emitted but never needs a forward
        assert stats.finish_reason == "length"


def test_prompt_longer_than_context_is_a_clear_error():
    model = tiny_model("llama", max_position_embeddings=16)
    with pytest.raises(SpecdecError, match="prompt has 20 tokens but the model's context is 16"):
        run(LeanRunner(model), NoDrafter(), list(range(20)), SamplingParams(), 5)


def test_perfect_draft_has_full_acceptance_and_stats_add_up():
    model = tiny_model("llama")
    drafter = DraftModelDrafter(LeanRunner(copy.deepcopy(model)), 97, chain_len=4)
    out, s = run(LeanRunner(model), drafter, PROMPTS[1], SamplingParams(), 41)
    assert s.accept_lengths == [5] * 8 and s.tau == 5.0
    assert s.alpha_by_depth == [1.0] * 4 and s.accept_histogram() == {5: 8}
    assert s.new_tokens == len(out) == 41
    assert s.total_time >= s.draft_time + s.verify_time + s.prefill_time


def test_prompt_lookup_is_lossless_and_finds_repeats():
    from specdec.drafters.base import DecodeContext
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    d = PromptLookupDrafter(max_ngram=2, chain_len=3)
    ctx = DecodeContext([5, 6, 7, 8, 9, 1, 6, 7], SamplingParams(), None, 8)
    assert d.propose(ctx).tokens.tolist() == [8, 9, 1]  # after "6 7" came "8 9 1"
    ctx.max_nodes = 1
    assert d.propose(ctx).tokens.tolist() == [8]
    assert len(d.propose(DecodeContext([1, 2, 3], SamplingParams(), None, 3))) == 0
    model = tiny_model("llama")
    prompt = [4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5]  # repetitive, so lookups hit
    want, _ = run(LeanRunner(model), NoDrafter(), prompt, SamplingParams(), 30)
    got, stats = run(LeanRunner(model), PromptLookupDrafter(), prompt, SamplingParams(), 30)
    assert got == want and stats.depth_tries[0] > 0


def test_a_lookup_chain_stops_at_an_end_token_and_the_answer_is_unchanged():
    """Nothing after an end token is emitted, so a chain that copies one on (a phrase of the prompt restated,
    then the chat template's <|im_end|><|im_start|>assistant) ends with it; greedy text stays vanilla's."""
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    d = PromptLookupDrafter(max_ngram=2, chain_len=6)
    ctx = DecodeContext([5, 6, 7, 2, 1, 3, 4, 9, 6, 7], SamplingParams(), None, 10, eos_ids=frozenset({2}))
    assert d.propose(ctx).tokens.tolist() == [2]
    ctx.eos_ids = frozenset()
    assert d.propose(ctx).tokens.tolist() == [2, 1, 3, 4, 9, 6]
    model = tiny_model("llama")
    prompt = [4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5]
    want, _ = run(LeanRunner(model), NoDrafter(), prompt, SamplingParams(), 30, eos={8})
    got, _ = run(LeanRunner(model), PromptLookupDrafter(), prompt, SamplingParams(), 30, eos={8})
    assert got == want


@pytest.mark.slow
def test_prompt_lookup_sampling_matches_vanilla_distribution():
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    model = flat_tiny()
    params = SamplingParams(1.1, top_k=4)
    prompt = [1, 3, 0, 2, 1, 3, 0, 2, 1]
    counts, sizes = sample_first3(LeanRunner(model), PromptLookupDrafter(chain_len=3), prompt, params)
    assert max(sizes) == 3
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_prompt_lookup_index_finds_what_a_full_scan_finds(tokens, grow):
    """The incremental n-gram index proposes exactly what a scan of the whole context proposes (the
    latest earlier occurrence of the longest matching suffix), as the context grows step by step."""
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    def scan(toks, k, max_ngram=3):
        for n in range(min(max_ngram, len(toks) - 1), 0, -1):
            hits = [e for e in range(n, len(toks)) if toks[e - n:e] == toks[-n:]]
            if hits:
                return n, toks[hits[-1]:hits[-1] + k]
        return 0, []

    d = PromptLookupDrafter(chain_len=4)
    ctx = DecodeContext(tokens[:1], SamplingParams(), None, 1, None)
    ctx.max_nodes = 9
    cut = 1
    for g in grow + [len(tokens)]:
        cut = min(len(tokens), cut + g)
        ctx.tokens.extend(tokens[len(ctx.tokens):cut])
        tree = d.propose(ctx)
        assert (d.last_ngram, tree.tokens.tolist()) == scan(ctx.tokens, 4)
    other = DecodeContext(list(reversed(ctx.tokens)), SamplingParams(), None, 1, None)  # a new request's list
    other.max_nodes = 9
    tree = d.propose(other)
    assert (d.last_ngram, tree.tokens.tolist()) == scan(other.tokens, 4)


def test_the_draft_vocabulary_is_the_most_frequent_ids_of_the_shipped_text_and_every_special(tmp_path,
                                                                                           monkeypatch):
    from specdec.vocab import draft_vocab, token_counts

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    tok = word_tokenizer(["zebra", "of", "the"])  # ids 0 <unk>, 1 </s>, 2 zebra, 3 of, 4 the
    counts = token_counts(tok, 5)
    assert counts[4] > counts[3] > counts[2] and counts[1] == 0  # "the" > "of" > "zebra"; </s> never in text
    assert draft_vocab(tok, 5, 3).tolist() == [0, 1, 4]  # the specials, then the most frequent word
    assert draft_vocab(tok, 5, 0) is None and draft_vocab(tok, 5, 5) is None  # the whole vocabulary
    assert list(tmp_path.glob("vocab/counts-*.pt"))  # counted once, then read from the cache
