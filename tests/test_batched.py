"""Batched data generation (left-padded rows on the lean weights) equals decoding each prompt alone."""

import pytest
import torch

from specdec.api import from_models
from specdec.runtime.batched import batch_generate
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from tests.helpers import at_threads, tiny_model

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them


class _Tok:  # token ids in, token ids out: enough for Decoder.generate with id prompts
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))



@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_greedy_batch_equals_single_sequence_decoding(fam):
    model = tiny_model(fam)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 5, 14, 1)]
    free, _ = batch_generate(LeanRunner(model), prompts, 12, SamplingParams(), set(), with_features=False)
    # an EOS that some rows emit mid-way and others never: rows finish at different steps
    eos = {next(t for t in free[0][2:] if any(t not in a for a in free[1:]))}
    answers, feats = batch_generate(LeanRunner(model), prompts, 12, SamplingParams(), eos)
    dec = from_models(model, _Tok())
    dec.eos_ids = eos
    finished = 0
    for p, a, f in zip(prompts, answers, feats):
        want = dec.generate(" ".join(map(str, p)), max_new_tokens=12).token_ids
        assert a == want
        finished += a[-1] in eos
        with torch.no_grad():  # features of prompt + answer = the HF model's last hidden state
            ref = model.get_decoder()(torch.tensor([p + a])).last_hidden_state[0]
        assert f.shape == ref.shape
        torch.testing.assert_close(f, ref, atol=1e-4, rtol=1e-4)
    assert 0 < finished < len(prompts)  # both early-finished rows and full-length rows were exercised


def test_sampled_batch_is_seeded_and_follows_the_distribution():
    model = tiny_model("llama")
    prompts = [[5, 6, 7]] * 400
    params = SamplingParams(temperature=1.0, top_k=5)
    a1, _ = batch_generate(LeanRunner(model), prompts, 1, params, set(), torch.Generator().manual_seed(3), False)
    a2, _ = batch_generate(LeanRunner(model), prompts, 1, params, set(), torch.Generator().manual_seed(3), False)
    assert a1 == a2
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    from specdec.sampling import probs_from_logits

    p = probs_from_logits(logits, params)
    counts = torch.bincount(torch.tensor([a[0] for a in a1]), minlength=97).float()
    assert set(counts.nonzero().flatten().tolist()) <= set(p.nonzero().flatten().tolist())  # top-k respected
    from scipy.stats import chisquare

    support = p.nonzero().flatten()
    assert chisquare(counts[support], p[support] * 400).pvalue > 1e-3


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_aux_layer_features_are_the_hidden_states_entering_those_layers(fam):
    """EAGLE-3's inputs: besides f_t, the hidden state entering each named layer, in the batched path
    and in datagen's teacher-forced fallback alike."""
    from specdec.training.datagen import eagle3_layers, teacher_force

    model = tiny_model(fam)
    n_layers = model.config.num_hidden_layers
    aux = tuple(eagle3_layers(n_layers))
    assert len(aux) >= 2 and all(0 <= i < n_layers for i in aux)
    hd = model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 11, 7)]
    answers, feats = batch_generate(LeanRunner(model), prompts, 6, SamplingParams(), set(), aux_layers=aux)
    forced = teacher_force(model, [p + a for p, a in zip(prompts, answers)], aux_layers=aux)
    for p, a, f, t in zip(prompts, answers, feats, forced):
        with torch.no_grad():
            out = model.get_decoder()(torch.tensor([p + a]), output_hidden_states=True)
        ref = torch.cat([out.last_hidden_state[0], *(out.hidden_states[i][0] for i in aux)], -1)
        assert f.shape == t.shape == (len(p) + len(a), hd * (1 + len(aux)))
        torch.testing.assert_close(f, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t, ref, atol=1e-4, rtol=1e-4)
