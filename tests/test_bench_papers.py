"""`specdec bench --preset papers-table`: the paper's layout with its published row, N/A where a method
lacks what it needs, Kendall's tau of the two orderings; bad combinations fail before any model loads."""

import argparse
import itertools
import math

import pytest

import specdec.bench.cli as bench_cli
from specdec.bench import papers
from specdec.bench.methods import MethodSpec
from specdec.bench.runner import answer_loglik
from specdec.cli import main
from specdec.heads.medusa_io import save_medusa
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.lean import LeanRunner
from tests.helpers import make_hydra, tiny_gguf


def concordance(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a from its definition (no ties in the test's values)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum(math.copysign(1, (a[i] - a[j]) * (b[i] - b[j])) for i, j in pairs)
    return s / len(pairs)


def row(md: str, model: str, method: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {model} | {method} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_table_has_the_papers_layout_na_rows_and_kendalls_tau():
    specs = {m: MethodSpec(m, {}, m) for m in papers.METHODS}
    plan = papers.Plan([], specs, {"sps": "no draft model (--draft)", "hydra": "no head", "fspad": "no head"})
    ours = {"pld": 1.3, "medusa": 1.1, "lookahead": 1.2, "eagle": 1.9, "eagle2": 2.4, "auto": 2.0}
    cols = list(papers.COLUMNS)
    # per column the method's mean times a column factor: the mean over the columns is the method's value
    factor = [0.8, 1.2, 1.0, 0.9, 1.1]
    summary = {m: {c: {"speedup_vs_vanilla": v * f, "tau": 1 + v} for c, f in zip(cols, factor)}
               for m, v in ours.items()}
    md = papers.table(plan, {0.0: summary}, "tiny")
    assert "## Temperature=0" in md and "Alpaca is not run" in md
    head = next(x for x in md.splitlines() if x.startswith("| Model | Method |"))
    assert [c.strip() for c in head.strip("|").split("|")][2::2] == [f"{papers.COLUMNS[c]} speedup" for c in cols] \
        + ["Mean speedup"]
    assert row(md, "tiny", "Hydra")[2:] == ["N/A"] * 12 and row(md, "tiny", "SpS")[2:] == ["N/A"] * 12
    eagle2 = row(md, "tiny", "EAGLE-2")
    assert eagle2[2] == f"{2.4 * 0.8:.2f}x" and eagle2[-2:] == ["2.40x", "3.40"]
    # the published Vicuna-7B row, the paper's own columns (Alpaca left out) and its Mean
    pub = papers.published()
    hydra = row(md, "V 7B (paper)", "Hydra")
    assert hydra[2:4] == [f"{pub['rows']['0']['hydra'][0][0]:.2f}x", f"{pub['rows']['0']['hydra'][0][1]:.2f}"]
    assert hydra[-2] == f"{pub['rows']['0']['hydra'][-1][0]:.2f}x"
    common = [m for m in pub["rows"]["0"] if m in ours]
    want = concordance([pub["rows"]["0"][m][-1][0] for m in common], [ours[m] for m in common])
    line = next(x for x in md.splitlines() if x.startswith("Kendall's τ"))
    assert f"{want:.2f} over {len(common)} methods" in line
    assert "N/A: SpS: no draft model (--draft); Hydra: no head; FSPAD: no head." in md


def test_kendall_needs_two_methods_in_common():
    assert papers.kendall({"pld": 1.0}, {"pld": 2.0, "auto": 3.0}) == (None, ["pld"])
    assert papers.kendall({"a": 1.0, "b": 2.0}, {"a": 5.0, "b": 4.0})[0] == pytest.approx(-1.0)


@pytest.mark.parametrize("argv, says", [
    (["--dataset", "gsm8k"], "picks its own questions"),
    (["--quick"], "--quick"),
    (["--methods", "vanilla"], "not 'vanilla'"),
    (["--methods", "hydra:tree=bushy"], "tree"),
])
def test_bad_combinations_fail_before_loading(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(bench_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["bench", "--preset", "papers-table", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error:") and says in err


def test_lookahead_runs_its_authors_setting_unless_given_options():
    def args(methods):
        return argparse.Namespace(methods=methods, per_task=1)

    spec = papers.plan(args(None), False).specs["lookahead"]
    assert spec.opts == {"window": 7, "ngram_size": 5, "guesses": 7}
    assert papers.plan(args("lookahead:window=2"), False).specs["lookahead"].opts == {"window": 2}


@pytest.mark.slow
def test_a_functional_run_on_a_tiny_target(bench_models, tmp_path, monkeypatch, capsys):
    """One question per column, 4 tokens, T = 0: the head methods without a head are N/A, Hydra with
    the heads given on --methods runs, and the table is written."""
    target, tok, _ = bench_models
    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    monkeypatch.setattr(bench_cli, "native_gguf", lambda *a: False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    save_medusa(make_hydra(target, 2), tmp_path / "hydra")
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "papers-table", "--per-task", "1", "--max-new-tokens", "4", "--temperatures",
               "0", "--warmup", "0", "--threads", "1", "--no-progress", "--first-turn", "--out", str(out),
               "--methods", f"hydra:heads={tmp_path / 'hydra'}:tree_size=3"])
    assert rc == 0
    md = (out / "papers-table.md").read_text()
    assert md in capsys.readouterr().out
    for m in ("SpS", "Medusa", "EAGLE", "EAGLE-2", "FSPAD"):
        assert row(md, "SmolLM2-135M-Instruct", m)[2:] == ["N/A"] * 12
    for m in ("PLD", "Lookahead", "Hydra", "auto"):
        cells = row(md, "SmolLM2-135M-Instruct", m)[2:]
        assert "N/A" not in cells and cells[-2].endswith("x")
    assert "Kendall's τ" in md and "over 3 methods (PLD, Lookahead, Hydra)" in md


def test_answer_loglik_of_a_gguf_target_is_its_runners(tmp_path):
    """T > 0 runs score the sampled answers with the target: a GGUF model has no HF forward, so its
    runner scores them, and agrees with the HF model holding the same (de-quantized) weights."""
    path, hf = tiny_gguf(tmp_path / "t.gguf", "Q8_0")
    model = GGUFModel(path, hf.config)
    prompt, answer = [5, 9, 11, 2], [7, 7, 30, 1, 64]
    want = answer_loglik(hf, prompt, answer)
    got = answer_loglik(model, prompt, answer, LeanRunner(model, weights="gguf"))
    assert got == pytest.approx(want, rel=0.01) and want < 0  # Q8_0 kernels round activations too


@pytest.mark.parametrize("model, label", [
    (None, "SmolLM2-135M-Instruct"),
    ("/m/qwen2.5-coder-1.5b-instruct/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
     "qwen2.5-coder-1.5b-instruct-q4_k_m"),
    ("/m/qwen2.5-coder-0.5b-instruct/", "qwen2.5-coder-0.5b-instruct"),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"),
])
def test_the_model_column_names_the_file_not_its_path(model, label):
    assert papers.model_label(model) == label
