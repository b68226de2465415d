"""The prefill in forwards of at most exact_rows rows: a prompt row's bits do not depend on how the prompt
was split, a request may step through its prefill's forwards one by one (what the benchmark interleaves),
and a request that loses the Decoder between them starts its prefill over and gives its own answer."""

import math

import pytest
import torch

from specdec.api import from_models
from specdec.engine import _advance, _prefill
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from tests.helpers import at_threads, word_tokenizer

WORDS = [f"w{i}" for i in range(95)]
LONG = " ".join(f"w{(7 * i) % 90}" for i in range(150))  # longer than two exact forwards
OTHER = " ".join(f"w{(11 * i + 3) % 90}" for i in range(100))

_threads = at_threads(2)  # the kernels' parallel paths, as a 2-core machine runs them


@pytest.fixture(scope="module")
def decoders(tiny, trained):
    tok = word_tokenizer(WORDS)
    _, head = trained
    return {m: from_models(tiny, tok, m, **({"head": str(head / "head")} if m == "auto" else {}))
            for m in ("vanilla", "auto")}


def test_a_prompt_rows_bits_do_not_depend_on_how_it_was_split(decoders):
    r = decoders["vanilla"].runner
    assert r.exact_rows > 0
    ids = decoders["vanilla"].encode(LONG)
    assert len(ids) > 2 * r.exact_rows
    whole = _advance(_prefill(r, ids))
    assert whole.features.shape[0] == len(ids)
    r.reset()  # the same rows split otherwise: 50-row forwards, then the last token alone
    feats = []
    for i in range(0, len(ids) - 1, 50):
        chunk = ids[i:min(i + 50, len(ids) - 1)]
        feats.append(r.forward(torch.tensor(chunk), logits_rows=slice(-1, None)).features)
        r.commit(range(len(chunk)))
    last = r.forward(torch.tensor(ids[-1:]), logits_rows=slice(-1, None))
    assert torch.equal(whole.logits, last.logits)
    assert torch.equal(whole.features, torch.cat(feats + [last.features]))


@pytest.mark.parametrize("method", ["vanilla", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_steps_through_its_prefill_forwards_and_gives_the_same_answer(decoders, method, temperature):
    dec = decoders[method]
    ids = dec.encode(LONG)
    params = SamplingParams(temperature, seed=3)
    want = [t for s in dec.steps(ids, params, 24, Stats()) for t in s]
    steps = list(dec.steps(ids, params, 24, Stats(), prefill_steps=True))
    parts = math.ceil(len(ids) / dec.runner.exact_rows)
    assert steps[:parts - 1] == [[]] * (parts - 1) and len(steps[parts - 1]) == 1
    assert [t for s in steps for t in s] == want


def test_requests_that_take_the_decoder_between_prefill_forwards_each_get_their_own_answer(decoders):
    dec = decoders["auto"]
    a, b = dec.encode(LONG), dec.encode(OTHER)
    params = SamplingParams(1.0, seed=9)
    want = [[t for s in dec.steps(p, params, 24, Stats()) for t in s] for p in (a, b)]
    stats = [Stats(), Stats()]
    runs = [dec.steps(p, params, 24, st, prefill_steps=True) for p, st in zip((a, b), stats)]
    got: list[list[int]] = [[], []]
    live = [0, 1]
    while live:  # strictly alternating: each prefill forward finds the other request's rows in the cache
        for i in list(live):
            step = next(runs[i], None)
            if step is None:
                live.remove(i)
            else:
                got[i] += step
    assert got == want
    assert stats[0].resumes > 0 and stats[1].resumes > 0  # the decoding steps after the prefill rebuilt too
