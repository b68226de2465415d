"""Hugging Face hub ids (`org/name`) as --model: from the hub cache without the network, and one clear line
when the cache lacks the model and the hub cannot be reached."""

import pytest
import torch

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.runtime.loading import load_model, resolve
from tests.helpers import tiny_model, word_tokenizer

REPO = "testorg/tiny-chat"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline hub cache in a temp HF_HOME, laid out as huggingface_hub writes it:
    models--org--name/snapshots/<rev>/... and refs/main."""
    import huggingface_hub.constants as hf

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these once, at import
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    return home / "hub"


def populate(cache, repo_id, model, tok):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snap


def test_a_cached_hub_id_loads_offline(hub_cache, tmp_path, monkeypatch, capsys):
    tok = word_tokenizer(["the", "cat", "sat", "on", "mat"])
    model = tiny_model("llama", vocab_size=7)
    snap = populate(hub_cache, REPO, model, tok)
    monkeypatch.chdir(tmp_path)  # not a relative path that happens to exist
    assert resolve(REPO) == snap
    loaded, ltok, d = load_model(REPO, device="cpu")
    assert d == snap and ltok.convert_tokens_to_ids("cat") == tok.convert_tokens_to_ids("cat")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert main(["generate", "the cat", "--raw", "--model", REPO, "--method", "vanilla",
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert "tok/s" in out.err and out.out.strip()


def test_a_local_directory_wins_over_a_hub_id(hub_cache, tmp_path, monkeypatch):
    populate(hub_cache, REPO, tiny_model("llama", vocab_size=7), word_tokenizer(["a"]))
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "testorg" / "tiny-chat"
    tiny_model("llama", vocab_size=7).save_pretrained(local)
    assert resolve(REPO).resolve() == local


def test_an_uncached_hub_id_offline_is_one_line_naming_the_flag(hub_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecdecError, match=r"^--model nobody/nothing: not a local path, not in the Hugging Face "
                                           r"cache, and the hub cannot be reached"):
        resolve("nobody/nothing")
    with pytest.raises(SpecdecError, match="^--draft nobody/nothing"):
        load_model("nobody/nothing", device="cpu", flag="--draft")
    assert main(["generate", "hi", "--model", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--model nobody/nothing" in err
    # a path that is not an id keeps its own message
    with pytest.raises(SpecdecError, match="does not exist"):
        resolve(str(tmp_path / "no" / "such" / "model"))
