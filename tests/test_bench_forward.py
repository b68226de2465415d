"""`specdec bench forward`: a table of forward times per row count, every option checked before a model loads."""

import pytest

from specdec.cli import main
from tests.helpers import tiny_model, word_tokenizer


def test_the_table_has_a_time_per_row_count_and_the_floor_share(tmp_path, capsys):
    word_tokenizer(["the", "cat"]).save_pretrained(tmp_path / "m")
    tiny_model("llama", vocab_size=4).save_pretrained(tmp_path / "m")
    out = tmp_path / "forward.md"
    assert main(["bench", "forward", "--model", str(tmp_path / "m"), "--rows", "4,1,2", "--reps", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    head, rule, row = out.read_text().splitlines()
    assert head.split(" | ")[3:7] == ["t(1) ms", "t(2) ms", "t(4) ms", "t(1) of floor |"]
    cells = row.strip("| ").split(" | ")
    assert cells[0] == "m" and len(cells) == len(head.strip("| ").split(" | "))
    assert all(float(c) > 0 for c in cells[3:6])  # the times (a tiny model's floor rounds to 0)


@pytest.mark.parametrize("argv,msg", [
    (["--rows", "0"], "--rows expects integers from 1 to 64"),
    (["--rows", "a,b"], "--rows expects a comma list"),
    (["--model", "/no/such/model"], "does not exist"),
])
def test_bad_options_are_one_line_before_any_model_loads(argv, msg, capsys, monkeypatch):
    import specdec.bench.forward as fwd

    monkeypatch.setattr(fwd, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["bench", "forward", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("specdec: error:") and "Traceback" not in err


def test_an_unwritable_out_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import specdec.bench.forward as fwd

    monkeypatch.setattr(fwd, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    (tmp_path / "file").write_text("")
    assert main(["bench", "forward", "--out", str(tmp_path / "file" / "forward.md")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and err.startswith("specdec: error: --out")
