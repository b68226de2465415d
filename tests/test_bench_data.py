"""The question sets shipped with the package: found from anywhere, unchanged from upstream."""

import hashlib
import json
import re

import pytest

from specdec.bench.data import MT_BENCH_CATEGORIES, load_questions
from specdec.errors import SpecdecError
from specdec.files import data_roots, find_data, packaged_data_dir
from specdec.training.datagen import Plan, check_run
from specdec.training.prompts import benchmark_prompts, is_benchmark


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """No $SPECDEC_DATA, and a working directory with nothing next to it."""
    monkeypatch.delenv("SPECDEC_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bench_default_data_loads_from_anywhere(fresh_clone):
    assert data_roots() == [packaged_data_dir()]
    spec = load_questions("spec_bench")
    assert len(spec) == 480 and len({q.question_id for q in spec}) == 480
    mt = load_questions("mt_bench")
    assert len(mt) == 80 and [q.question_id for q in mt] == [q.question_id for q in spec[:80]]
    assert {q.category for q in mt} == set(MT_BENCH_CATEGORIES) and all(len(q.turns) == 2 for q in mt)
    gsm = load_questions("gsm8k")
    assert len(gsm) == 1319 and all(q.category == "gsm8k" and q.turns[0] for q in gsm)


def test_specdec_data_and_questions_override_the_packaged_files(fresh_clone, monkeypatch):
    env = fresh_clone / "env"
    (env / "spec_bench").mkdir(parents=True)
    row = {"question_id": 7, "category": "writing", "turns": ["Hello there"]}
    (env / "spec_bench" / "question.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("SPECDEC_DATA", str(env))
    assert [q.turns for q in load_questions("spec_bench")] == [["Hello there"]]
    assert find_data("gsm8k/test.jsonl") == packaged_data_dir() / "gsm8k" / "test.jsonl"  # not in env: shipped
    own = fresh_clone / "mine.jsonl"
    own.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    assert [q.turns for q in load_questions("gsm8k", own)] == [["What is 1 + 1?"]]


def _readme_sums(readme):
    return dict(re.findall(r"sha256 `([^`]+)`: ([0-9a-f]{64})", readme.read_text()))


@pytest.mark.parametrize("sub", ["spec_bench", "gsm8k"])
def test_packaged_files_match_their_readme(sub):
    d = packaged_data_dir() / sub
    sums = _readme_sums(d / "README.md")
    assert sums and sorted(sums) == sorted(p.name for p in d.glob("*.jsonl"))  # every data file is listed
    for name, want in sums.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == want, name
    assert (d / "LICENSE").read_text().strip()


def test_datagen_default_data_and_benchmark_filter_from_packaged_files(fresh_clone):
    gsm, excl = check_run(fresh_clone / "out", 1, Plan(sources=["gsm8k"]), 4, None, None, "float16")
    assert gsm == packaged_data_dir() / "gsm8k" / "train.jsonl" and excl == [packaged_data_dir()]
    assert not (fresh_clone / "out").exists()
    bench = benchmark_prompts(excl)
    spec = load_questions("spec_bench")
    assert all(is_benchmark(t, bench) for q in spec for t in q.turns)  # both MT-bench turns too
    assert is_benchmark(load_questions("gsm8k")[5].turns[0], bench)  # bench --dataset gsm8k's questions
    train = [json.loads(line)["question"] for line in gsm.read_text().splitlines()[:50]]
    assert not any(is_benchmark(q, bench) for q in train)
    assert not is_benchmark("Write a haiku about the sea.", bench)


def test_datagen_missing_gsm8k_file_is_one_line(fresh_clone):
    with pytest.raises(SpecdecError, match="GSM8K train file not found at .*nope.jsonl"):
        check_run(fresh_clone / "out", 1, Plan(sources=["gsm8k"]), 4, fresh_clone / "nope.jsonl", None, "float16")
