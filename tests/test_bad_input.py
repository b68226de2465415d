"""Bad input gets one clear error (SpecdecError; a one-line message from the CLI), never a traceback."""

import pytest

from specdec.api import from_models
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.runtime.loading import check_same_vocab, load_model, materialize
from tests.helpers import tiny_model, word_tokenizer


def test_mismatched_vocabularies():
    a = word_tokenizer(["the", "cat", "sat"])
    b = word_tokenizer(["the", "sat", "cat"])
    check_same_vocab(a, word_tokenizer(["the", "cat", "sat"]))
    with pytest.raises(SpecdecError, match="does not match the target tokenizer.*2 with different ids"):
        check_same_vocab(a, b)
    model = tiny_model("llama", vocab_size=5)
    with pytest.raises(SpecdecError, match="share the target's vocabulary"):
        from_models(model, a, "sps", tiny_model("llama", vocab_size=5), b)


def test_over_long_prompt_through_the_api():
    tok = word_tokenizer(["the", "cat", "sat"])
    dec = from_models(tiny_model("llama", vocab_size=5, max_position_embeddings=8), tok)
    with pytest.raises(SpecdecError, match="prompt has 9 tokens but the model's context is 8"):
        dec.generate("the cat sat the cat sat the cat sat", max_new_tokens=4)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop"),
])
def test_invalid_generation_parameters(kw, msg):
    tok = word_tokenizer(["the", "cat", "sat"])
    dec = from_models(tiny_model("llama", vocab_size=5), tok)
    with pytest.raises(SpecdecError, match=msg):
        dec.generate("the cat", **{"max_new_tokens": 4, **kw})


def test_nonexistent_model_path(tmp_path):
    with pytest.raises(SpecdecError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match="without config.json"):
        load_model(tmp_path / "empty")


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(SpecdecError, match="could not read GGUF file"):
        materialize(bad)
    assert not any((tmp_path / "cache").rglob("config.json"))  # nothing half-written is cached


def test_corrupt_safetensors(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    word_tokenizer(["a"]).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(SpecdecError, match="could not load a model"):
        load_model(tmp_path, device="cpu")


def test_unknown_method_and_options():
    tok = word_tokenizer(["a"])
    with pytest.raises(SpecdecError, match="unknown method"):
        from_models(tiny_model("llama", vocab_size=3), tok, "telepathy")
    with pytest.raises(SpecdecError, match="unknown option"):
        from_models(tiny_model("llama", vocab_size=3), tok, "vanilla", gamma=3)


@pytest.mark.parametrize("argv,msg", [
    (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
    (["generate", "hi", "--temperature", "-0.5", "--model", "/no/such/model"], "temperature"),
    (["generate", "hi", "--top-p", "2", "--model", "/no/such/model"], "top_p"),
    (["generate", "hi", "--method", "nope"], "unknown method"),
])
def test_cli_prints_one_clear_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and err.startswith("specdec: error:")


def test_cli_generate_end_to_end(tmp_path, capsys):
    tok = word_tokenizer(["the", "cat", "sat", "on", "mat"])
    tiny_model("llama", vocab_size=7).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert main(["generate", "the cat", "--raw", "--model", str(tmp_path), "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert "tok/s" in out.err and "tau" in out.err and "target forwards" in out.err
    assert out.out.strip()  # the streamed answer


@pytest.mark.parametrize("method", ["sps", "sps-tree"])
def test_a_draft_with_a_shorter_window_stops_drafting_instead_of_failing(method):
    tok = word_tokenizer([f"w{i}" for i in range(95)])
    target = tiny_model("llama", max_position_embeddings=128)
    short = tiny_model("llama", seed=1, max_position_embeddings=24)
    prompt = " ".join(f"w{i % 7}" for i in range(12))
    want = from_models(target, tok).generate(prompt, max_new_tokens=40).token_ids
    g = from_models(target, tok, method, short, tok).generate(prompt, max_new_tokens=40)
    assert g.token_ids == want and len(want) > 24 - 12  # it went past the draft's window, exactly
    assert g.stats.tree_sizes[-1] == 0  # plain target steps once the draft's window is full
