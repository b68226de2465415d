"""The suite runs on a cache of its own (conftest): what the user's ~/.cache/specdec holds (costs measured
under load or on one thread, tuning results, converted models) changes nothing the tests see."""

import json
import os
from pathlib import Path

from specdec.api import from_models
from specdec.files import cache_dir
from tests.helpers import tiny_model


def test_the_cache_is_the_suites_own_and_subprocesses_inherit_it():
    ours = cache_dir().resolve()
    assert os.environ["SPECDEC_CACHE"] == str(cache_dir())
    users = (Path.home() / ".cache" / "specdec").resolve()
    assert ours != users and users not in ours.parents


def test_a_poisoned_user_cache_changes_nothing(tmp_path, monkeypatch):
    """Costs for the very key `auto` looks up, absurd ones (drafting priced as free), in the cache the user's
    home would give: `auto` keeps the costs the suite's cache holds."""
    model = tiny_model("llama", seed=3)
    first = from_models(model, None, "auto").drafter
    assert first.cache.parent.parent.resolve() == cache_dir().resolve()
    monkeypatch.setenv("HOME", str(tmp_path))
    theirs = tmp_path / ".cache" / "specdec" / "costs" / first.cache.name
    theirs.parent.mkdir(parents=True)
    rec = json.loads(first.cache.read_text())
    rec["costs"]["target_s"] = {n: 1000 * t if n == "1" else t for n, t in rec["costs"]["target_s"].items()}
    theirs.write_text(json.dumps(rec))
    again = from_models(model, None, "auto").drafter
    assert again.origin == "cached" and again.cache == first.cache
    assert again.costs.to_json() == first.costs.to_json()
