"""One Decoder shared by threads, and a stream interrupted by another request on the same Decoder:
every answer equals the one the same request gets alone."""

import threading

import pytest

from specdec.api import from_models
from tests.helpers import word_tokenizer

WORDS = [f"w{i}" for i in range(95)]  # with <unk> and </s>: the tiny model's 97 ids
PROMPTS = ["w3 w17 w5 w3 w17", "w40 w41 w42 w43 w40 w41", "w9 w9 w8 w7 w60 w61 w9 w9", "w70 w2 w33"]
GREEDY = dict(max_new_tokens=40)
SAMPLED = dict(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5)
METHODS = ["vanilla", "pld", "eagle2", "auto"]


@pytest.fixture(scope="module")
def decoders(tiny, trained):
    tok = word_tokenizer(WORDS)
    _, head = trained
    out = {}
    for m in METHODS:
        opts = {"head": str(head / "head")} if m in ("eagle2", "auto") else {}
        if m == "auto":
            opts["lookup"] = 3  # the union of tree and lookup chain: the most drafter state to get wrong
        out[m] = from_models(tiny, tok, m, **opts)
    return out


def alone(dec, prompt, kw):
    return dec.generate(prompt, **kw).token_ids


@pytest.mark.parametrize("method", METHODS)
def test_threads_sharing_a_decoder_get_their_own_answers(decoders, method):
    dec = decoders[method]
    jobs = [(p, kw) for p in PROMPTS for kw in (GREEDY, SAMPLED)]
    want = [alone(dec, p, kw) for p, kw in jobs]
    assert any(len(w) > 10 for w in want)
    got: list = [None] * len(jobs)
    errors: list = []
    start = threading.Barrier(len(jobs))

    def work(i):
        try:
            start.wait()
            got[i] = alone(dec, *jobs[i])
        except Exception as e:  # surfaced below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == want


@pytest.mark.parametrize("kw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_a_stream_interrupted_by_generate_continues_exactly(decoders, method, kw):
    dec = decoders[method]
    want_a, want_b = alone(dec, PROMPTS[0], kw), alone(dec, PROMPTS[1], kw)
    s = dec.stream(PROMPTS[0], **kw)
    head = [next(s), next(s)]
    assert dec.generate(PROMPTS[1], **kw).token_ids == want_b  # takes the Decoder over
    rest = list(s)  # A rebuilds its state from its own tokens and goes on
    final = rest[-1].final
    assert final.token_ids == want_a
    assert "".join(c.text for c in head + rest) == final.text
    assert final.stats.resumes == 1


def test_two_interleaved_streams_in_one_thread(decoders):
    dec = decoders["eagle2"]
    want = [alone(dec, p, GREEDY) for p in PROMPTS[:2]]
    a, b = dec.stream(PROMPTS[0], **GREEDY), dec.stream(PROMPTS[1], **GREEDY)
    got: list[list] = [[], []]
    live = [a, b]
    while live:  # strictly alternating steps: every step of each rebuilds its state
        for i, s in enumerate((a, b)):
            if s in live:
                c = next(s, None)
                if c is None or c.final is not None:
                    live.remove(s)
                    if c is not None:
                        got[i] = c.final.token_ids
    assert got == want


def test_another_thread_waits_for_a_suspended_stream_instead_of_taking_it(decoders):
    dec = decoders["pld"]
    want_a, want_b = alone(dec, PROMPTS[0], GREEDY), alone(dec, PROMPTS[2], GREEDY)
    s = dec.stream(PROMPTS[0], **GREEDY)
    first = next(s)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("b", alone(dec, PROMPTS[2], GREEDY)))
    t.start()
    t.join(1.0)
    assert t.is_alive() and "b" not in result  # serialized: B waits for A's request to end
    rest = list(s)
    t.join(60)
    assert result["b"] == want_b
    assert rest[-1].final.token_ids == want_a and rest[-1].final.stats.resumes == 0
    assert first.text + "".join(c.text for c in rest) == rest[-1].final.text


def test_an_abandoned_stream_frees_the_decoder(decoders):
    dec = decoders["vanilla"]
    s = dec.stream(PROMPTS[0], **GREEDY)
    next(s)
    s.close()  # what garbage collection does to a stream nobody reads any more
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("b", alone(dec, PROMPTS[1], GREEDY)))
    t.start()
    t.join(60)
    assert result["b"] == alone(dec, PROMPTS[1], GREEDY)
