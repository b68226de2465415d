"""Datagen on the serving engine: answers from continuous batching equal decoding each prompt alone, sampled
answers follow the target's distribution, and the features of whole sequences are the model's hidden states."""

import pytest
import torch

from specdec.api import from_models
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.training.features import engine_answers, runner_features
from tests.helpers import at_threads, tiny_model

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them


class _Tok:  # token ids in, token ids out: enough for Decoder.generate with id prompts
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_greedy_engine_answers_equal_single_sequence_decoding(fam):
    model = tiny_model(fam)
    runner = LeanRunner(model, exact=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 5, 14, 1, 70)]
    free = engine_answers(runner, prompts, 12, SamplingParams(), set(), width=6)
    # an EOS that some answers emit mid-way and others never: sequences leave at different steps
    eos = {next(t for t in free[0][2:] if any(t not in a for a in free[1:]))}
    answers = engine_answers(runner, prompts, 12, SamplingParams(), eos, width=3)  # later prompts join as others leave
    dec = from_models(model, _Tok())
    dec.eos_ids = eos
    finished = 0
    for p, a in zip(prompts, answers):
        assert a == dec.generate(" ".join(map(str, p)), max_new_tokens=12).token_ids
        finished += a[-1] in eos
    assert 0 < finished < len(prompts)  # both early-finished and full-length answers were exercised


def test_sampled_engine_answers_are_reproducible_and_follow_the_distribution():
    model = tiny_model("llama")
    runner = LeanRunner(model, exact=True)
    prompts = [[5, 6, 7]] * 300
    params = SamplingParams(temperature=1.0, top_k=5)
    torch.manual_seed(3)
    a1 = engine_answers(runner, prompts, 1, params, set(), width=64)
    torch.manual_seed(3)
    a2 = engine_answers(runner, prompts, 1, params, set(), width=64)
    assert a1 == a2
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    p = probs_from_logits(logits, params)
    counts = torch.bincount(torch.tensor([a[0] for a in a1]), minlength=p.numel()).float()
    support = p.nonzero().flatten()
    assert set(counts.nonzero().flatten().tolist()) <= set(support.tolist())  # top-k respected
    from scipy.stats import chisquare

    assert chisquare(counts[support], p[support] * len(prompts)).pvalue > 1e-3


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_runner_features_are_the_hidden_states_entering_the_aux_layers(fam):
    """f_t after the final norm, then EAGLE-3's inputs (the hidden state entering each named layer), from
    prefill forwards of exact rows (a sequence longer than one forward included), as datagen's HF fallback
    computes them."""
    from specdec.training.datagen import eagle3_layers, teacher_force

    model = tiny_model(fam)
    aux = tuple(eagle3_layers(model.config.num_hidden_layers))
    hd = model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 11, 150)]
    feats = runner_features(LeanRunner(model, exact=True), seqs, aux)
    forced = teacher_force(model, seqs, aux_layers=aux)
    for s, f, t in zip(seqs, feats, forced):
        with torch.no_grad():
            out = model.get_decoder()(torch.tensor([s]), output_hidden_states=True)
        ref = torch.cat([out.last_hidden_state[0], *(out.hidden_states[i][0] for i in aux)], -1)
        assert f.shape == t.shape == (len(s), hd * (1 + len(aux)))
        torch.testing.assert_close(f, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t, ref, atol=1e-4, rtol=1e-4)
