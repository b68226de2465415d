"""`specdec bench` argument checks that must fail before any model loads (one clear line, no traceback),
and the results dir: refused when not empty, cleared by --overwrite only once every option is checked."""

import json

import pytest

import specdec.bench.cli as bench_cli
from specdec.cli import main
from tests.helpers import char_tokenizer, tiny_model


@pytest.fixture
def no_load(monkeypatch):
    """load_model, patched where the bench CLI uses it: any call is a test failure."""
    calls = []

    def load(*a, **k):
        calls.append(a)
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(bench_cli, "load_model", load)
    return calls


@pytest.fixture
def qfile(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}) + "\n")
    return q


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("flag, value", [
    ("--limit", "0"), ("--per-category", "0"), ("--repeats", "0"), ("--warmup", "-1"),
    ("--max-new-tokens", "0"), ("--threads", "0"), ("--temperature", "-0.5"), ("--temperature", "nan"),
    ("--seed", "-1"), ("--limit", "two"),
])
def test_bad_numbers_fail_before_loading(tmp_path, qfile, no_load, capsys, flag, value):
    try:  # bench-only counts are argparse's errors; shared parameters are the schema's SpecdecError
        code = main(["bench", "--questions", str(qfile), "--out", str(tmp_path / "o"), flag, value])
    except SystemExit as e:
        code = e.code
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert flag in line or flag[2:].replace("-", "_") in line
    assert not no_load and not (tmp_path / "o").exists()


def _bench_error(argv, capsys) -> str:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error:")
    return one_error_line(err)


def test_unwritable_out_is_one_line(tmp_path, qfile, no_load, capsys):
    assert "--out" in _bench_error(["--questions", str(qfile), "--out", "/proc/x"], capsys)
    (tmp_path / "f").write_text("a file")
    assert "--out" in _bench_error(["--questions", str(qfile), "--out", str(tmp_path / "f")], capsys)
    assert not no_load


def test_default_out_is_checked_too(tmp_path, qfile, no_load, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").write_text("a file where the default results dir goes")
    assert "--out" in _bench_error(["--questions", str(qfile)], capsys)
    assert not no_load


def test_compare_out_parent_is_checked_first(tmp_path, capsys):
    # A and B are not results dirs either: the --out error comes first, before any work
    line = _bench_error(["compare", str(tmp_path), str(tmp_path), "--out", "/proc/x/cmp.md"], capsys)
    assert "--out" in line
    assert "--out" in _bench_error(["compare", str(tmp_path), str(tmp_path), "--out", str(tmp_path)], capsys)


def _earlier_run(out):
    (out / "raw").mkdir(parents=True)
    (out / "plots").mkdir()
    (out / "raw" / "sps_gamma=9.jsonl").write_text("{}\n")
    (out / "plots" / "old.png").write_bytes(b"old")
    (out / "run.json").write_text("{}")
    (out / "report.md").write_text("old report")


def test_non_empty_out_is_refused_without_overwrite(tmp_path, qfile, no_load, capsys):
    out = tmp_path / "res"
    _earlier_run(out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    line = _bench_error(["--questions", str(qfile), "--out", str(out)], capsys)
    assert "--out" in line and "--overwrite" in line and "another dir" in line
    # --overwrite, but another argument is wrong: nothing is deleted
    _bench_error(["--questions", str(qfile), "--out", str(out), "--overwrite", "--methods", "vanilla,warp9"], capsys)
    # --overwrite never clears a dir that holds no bench results
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    line = _bench_error(["--questions", str(qfile), "--out", str(tmp_path / "notes"), "--overwrite"], capsys)
    assert "--out" in line and "no run.json" in line
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert not no_load


def test_overwrite_replaces_an_earlier_run(tmp_path, qfile, monkeypatch, capsys):
    tok = char_tokenizer()
    target = tiny_model("llama", vocab_size=len(tok))
    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    out = tmp_path / "res"
    _earlier_run(out)
    args = ["bench", "--questions", str(qfile), "--max-new-tokens", "4", "--threads", "1", "--warmup", "0",
            "--no-progress", "--out", str(out), "--overwrite"]
    # an option only checked once the model is loaded: still before anything is deleted
    assert main([*args, "--methods", "vanilla,hf-pld:bogus_field=3"]) == 2
    assert "bogus_field" in one_error_line(capsys.readouterr().err)
    assert (out / "raw" / "sps_gamma=9.jsonl").exists() and (out / "report.md").read_text() == "old report"
    assert main([*args, "--methods", "vanilla,hf"]) == 0
    assert {p.name for p in (out / "raw").iterdir()} == {"vanilla.jsonl", "hf.jsonl"}
    assert not (out / "plots" / "old.png").exists()
    assert json.loads((out / "run.json").read_text())["generations"] == 2
    assert "old report" not in (out / "report.md").read_text()
