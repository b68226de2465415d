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


def test_the_long_context_set_grows_by_length_and_asks_for_what_its_text_holds():
    from specdec.bench.long_context import LENGTHS, PER_LENGTH

    qs = load_questions("long")
    rag = load_questions("spec_bench", categories=["rag"])
    assert len(qs) == 3 * len(LENGTHS) * PER_LENGTH and len({q.question_id for q in qs}) == len(qs)
    assert [q.turns for q in qs] == [q.turns for q in load_questions("long")]  # the same set every time
    for kind in ("summarize", "rag", "code"):
        sizes = [len(q.turns[0]) for label in LENGTHS for q in qs if q.category == f"{kind}-{label}"]
        assert len(sizes) == len(LENGTHS) * PER_LENGTH
        first = sizes[::PER_LENGTH]  # the first prompt of each length: each about twice the one before
        assert all(1.8 * a < b < 2.2 * a for a, b in zip(first, first[1:]))
    for q in qs:
        if q.category.startswith("code"):
            name = re.search(r"Rename the function `(\w+)`", q.turns[0])[1]
            assert re.search(rf"def {name}\(", q.turns[0])
        if q.category.startswith("rag"):  # the question of a passage the prompt holds
            asked = q.turns[0].rsplit("Answer from the passages above: ", 1)[1]
            assert asked and any(r.turns[0].endswith(asked) and r.turns[0].rsplit("\n", 1)[0][:200] in q.turns[0]
                                 for r in rag)
    picked = load_questions("long", categories=["code-8k"])
    assert [q.category for q in picked] == ["code-8k"] * PER_LENGTH
