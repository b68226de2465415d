"""Every declared parameter, drawn at random (wrong types, negatives, NaN/inf, huge ints, empty strings,
unknown keys): the answer is either one SpecdecError naming the parameter, or a correct generation.
Never another exception."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.api import GenerationParams, from_models
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.runtime.loading import Runtime
from tests.helpers import tiny_model, word_tokenizer

WORDS = [f"w{i}" for i in range(95)]
PROMPT = "w3 w17 w5 w3 w17 w5"
TEXTS = ["", " ", "0", "1", "-1", "2", "1.5", "1e-45", "nan", "inf", "-inf", "true", "false", "none", "abc",
         "[[0]]", "[[0],[1],[0,0]]", "[]", "99999999999999999999999", "value", "confidence", "\udcff"]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 12), st.integers(-10**30, 10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-45, 3.0), st.sampled_from(TEXTS),
    st.text(max_size=4), st.lists(st.lists(st.integers(-1, 3), max_size=3), max_size=4), st.just(object()),
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def keys_of(schema) -> list[str]:
    return [p.name for p in schema.params()] + [a for p in schema.params() for a in p.aliases]


def names_it(err: SpecdecError, key: str, schema) -> bool:
    return any(n and n in str(err) for n in (repr(key), key, schema.aliases().get(key)))


@pytest.fixture(scope="module")
def setup(tiny, trained):
    tok = word_tokenizer(WORDS)
    want = {k: from_models(tiny, tok).generate(PROMPT, max_new_tokens=k).token_ids for k in (1, 2, 3, 4)}
    return tok, str(trained[1] / "head"), tiny_model("llama", seed=3), want


@pytest.mark.parametrize("method", registry.names())
@given(data=st.data())
@SETTINGS
def test_any_method_option_gives_one_clear_error_or_a_lossless_answer(setup, tiny, method, data):
    tok, head, draft, want = setup
    m = registry.get(method)
    keys = keys_of(m.options) + ["bogus", "Depth", ""]
    raw = data.draw(st.dictionaries(st.sampled_from(keys), VALUES, max_size=3))
    if "head" in keys:  # a random path is a clear "not a directory" error; keep most draws on the real head
        raw["head"] = data.draw(st.sampled_from([head, head, raw.get("head", head)]))
    try:
        dec = from_models(tiny, tok, method, draft, tok, **raw)
        got = dec.generate(PROMPT, max_new_tokens=4).token_ids
    except SpecdecError as e:
        assert "\n" not in str(e)
        assert any(names_it(e, k, m.options) for k in raw), str(e)
        return
    assert got == want[4]  # greedy: token-identical to vanilla, whatever the (valid) options


@given(data=st.data())
@SETTINGS
def test_any_generation_parameter_gives_one_clear_error_or_an_answer(setup, tiny, data):
    tok, _, _, want = setup
    dec = from_models(tiny, tok, "pld")
    keys = keys_of(GenerationParams) + ["max_tokens", "temp"]
    kw = data.draw(st.dictionaries(st.sampled_from(keys), VALUES, max_size=3))
    if isinstance(kw.get("max_new_tokens"), int) and not isinstance(kw["max_new_tokens"], bool):
        kw["max_new_tokens"] = max(-1, min(kw["max_new_tokens"], 4))  # keep valid draws short
    try:
        g = dec.generate(PROMPT, **kw)
    except SpecdecError as e:
        assert "\n" not in str(e)
        assert any(k in str(e) for k in kw), str(e)
        return
    n = kw.get("max_new_tokens", 256)
    assert 1 <= len(g.token_ids) <= n
    assert all(0 <= t < 97 for t in g.token_ids)
    if kw.get("temperature", 0.0) == 0.0 and n <= 4 and not kw.get("stop"):
        assert g.token_ids == want[n]


@given(kw=st.dictionaries(st.sampled_from(keys_of(Runtime) + ["gpu"]), VALUES, max_size=2))
@SETTINGS
def test_any_runtime_setting_gives_one_clear_error_or_a_valid_one(kw):
    try:
        rt = Runtime(**kw)
    except SpecdecError as e:
        assert "\n" not in str(e) and any(k in str(e) for k in kw), str(e)
        return
    assert rt.backend in ("auto", "lean", "hf") and (rt.threads is None or rt.threads >= 1)


@given(t=st.floats(0, 1e-30, exclude_min=True))
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_a_tiny_temperature_behaves_like_its_limit(setup, tiny, t):
    tok, head, _, want = setup
    for dec in (from_models(tiny, tok, "vanilla"), from_models(tiny, tok, "eagle2", head=head)):
        g = dec.generate(PROMPT, max_new_tokens=4, temperature=t, seed=0)
        assert g.token_ids == want[4]  # the limit T -> 0 is greedy (no NaN anywhere on the way)


def test_text_values_convert_like_the_api_takes_them():
    assert GenerationParams.parse({"temperature": "0.5", "seed": "3", "max_new_tokens": "7"}) == \
        GenerationParams(temperature=0.5, seed=3, max_new_tokens=7)
    _, o = registry.parse("eagle", {"choices": "[[0],[1],[0,0]]", "full_vocab": "true"})
    assert o.choices == [[0], [1], [0, 0]] and o.full_vocab is True
    with pytest.raises(SpecdecError, match=r"method 'sps': chain_len \(given as 'gamma'\) must be an integer >= 1"):
        registry.parse("sps", {"gamma": "0"})
    with pytest.raises(SpecdecError, match="top_k must be an integer >= 0, got True"):
        GenerationParams(top_k=True)  # the API is strict: True is not 1
    assert not math.isnan(GenerationParams(temperature=1e-45).temperature)
