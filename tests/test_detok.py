"""A growing answer's text, decoded from a moving anchor, is always the whole answer decoded at once: over
byte-level BPE (UTF-8 characters split across tokens), a SentencePiece-style decoder that strips the text's
leading space, and a tokenizer that cleans up spaces across tokens; and a step decodes a bounded tail."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.detok import GrowingText
from tests.helpers import word_tokenizer

TEXTS = ["The sky is blue because of Rayleigh scattering.", "def f(x):\n    return x ** 2  # 平方",
         "日本語のテキストと emoji 🙂🚀 mixed in.", "Ünïcödé — “quotes” … and tabs\t."]


def check_growing(decode, ids, cuts):
    """Feed ids in pieces of the given sizes, in turn: after each, the text is decode(ids so far). Returns the
    GrowingText, the most ids one decode saw and the bound on it."""
    seen = []
    text = GrowingText(lambda xs: seen.append(len(xs)) or decode(xs))
    at, k = 0, 0
    while at < len(ids):
        piece = ids[at:at + cuts[k % len(cuts)]]
        at, k = at + len(piece), k + 1
        assert text.extend(piece) == decode(ids[:at])
    bound = GrowingText.LAG + GrowingText.EVERY + max(cuts)
    return text, max(seen), bound


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_level_text_is_the_whole_decode_at_every_step(smol, data):
    # real answers' ids (characters split over byte tokens), random ids and the chat's special tokens mixed in
    pool = [i for t in TEXTS for i in smol.encode(t)] + smol.all_special_ids
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, smol.vocab_size - 1)),
                             min_size=60, max_size=300))
    cuts = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=20))
    decode = lambda xs: smol.decode(xs, skip_special_tokens=True)  # noqa: E731
    check_growing(decode, ids, cuts)


def test_a_long_answer_decodes_a_bounded_tail(smol):
    ids = smol.encode(" ".join(TEXTS * 20))
    text, longest, bound = check_growing(lambda xs: smol.decode(xs), ids, [1, 2, 3])
    assert len(ids) > 10 * bound
    assert longest <= bound  # not the whole answer: a stream's step costs the same at any length
    assert text.anchor > len(ids) - bound


def metaspace_tokenizer():
    """SentencePiece's decoding: '▁' is a space, and the text's first one is stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "</s>", "▁the", "▁cat", "s", "at", "▁", "▁on", "mat", ".", "▁a"]
    tk = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(2, 10), min_size=40, max_size=200), cuts=st.lists(st.integers(1, 4), min_size=1))
def test_a_decoder_that_strips_the_leading_space_never_loses_one(ids, cuts):
    tok = metaspace_tokenizer()
    assert tok.decode([3, 4]) == "cats"  # the first space is stripped: an anchor before ▁cat would drop it
    check_growing(tok.decode, ids, cuts)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(2, 8), min_size=40, max_size=200), cuts=st.lists(st.integers(1, 4), min_size=1))
def test_cleaned_up_spaces_across_tokens_stay_cleaned(ids, cuts):
    tok = word_tokenizer(["I", "do", "n't", ".", "it", "'s", "?"])
    tok.clean_up_tokenization_spaces = True
    assert tok.decode([2, 3, 4, 5]) == "I don't."  # the cleanup joins a token to the one before it
    check_growing(tok.decode, ids, cuts)
