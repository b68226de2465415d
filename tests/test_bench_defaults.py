"""What `specdec bench` runs by default and how it says so: the methods (help, banner and run agree, `auto`
timed), the plots' setting in their titles, the per-method contention note, the progress bar's wording."""

import json
import re

import pytest

import specdec.bench.cli as bench_cli
from specdec.bench import report, runner
from specdec.bench.data import Question
from specdec.bench.methods import DEFAULT_METHODS, parse_methods
from specdec.bench.runner import BenchConfig, run_bench
from specdec.cli import build_parser, main
from specdec.errors import SpecdecError


def _banner_methods(err: str) -> list[str]:
    line = next(x for x in err.splitlines() if x.startswith("specdec bench:"))
    return re.search(r"methods (.*?), max_new_tokens", line).group(1).split(", ")


def _methods_help() -> str:
    bench = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()
                 if a.prog.endswith(" bench"))
    return next(a.help for a in bench._actions if "--methods" in a.option_strings)


@pytest.fixture
def hf_target(bench_models, monkeypatch):
    """The bench CLI on the tiny HF target (not the embedded GGUF one): the HF peers run too."""
    target, tok, _ = bench_models
    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    monkeypatch.setattr(bench_cli, "native_gguf", lambda *a: False)


@pytest.fixture
def qfile(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]}) + "\n")
    return q


def test_default_run_times_auto_and_the_banner_lists_what_runs(hf_target, qfile, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # auto's measured costs
    out = tmp_path / "res"
    rc = main(["bench", "--questions", str(qfile), "--max-new-tokens", "6", "--threads", "1", "--warmup", "0",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    ran = [m["label"] for m in json.loads((out / "run.json").read_text())["methods"]]
    assert "auto" in ran and ran == list(DEFAULT_METHODS)  # the tiny target has no shipped head
    assert _banner_methods(capsys.readouterr().err) == ran
    for m in ran:  # the help names every default method
        assert re.search(rf"\b{re.escape(m)}\b", _methods_help().split("Default:")[1]), m


def test_a_shipped_head_adds_eagle2_to_the_banner_too(hf_target, qfile, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "find_shipped_head", lambda model: tmp_path)
    seen = []

    def stop(cfg, *a, **k):
        seen.extend(s.label for s in cfg.methods)
        raise SpecdecError("stopped before timing")

    monkeypatch.setattr(bench_cli, "run_bench", stop)
    assert main(["bench", "--questions", str(qfile), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert seen == [*DEFAULT_METHODS, "eagle2"] == _banner_methods(capsys.readouterr().err)
    assert "eagle2" in _methods_help().split("Default:")[1]
    # --methods: exactly those (and the baselines), nothing added
    seen.clear()
    main(["bench", "--questions", str(qfile), "--methods", "pld", "--no-progress", "--out", str(tmp_path / "o")])
    assert seen == ["vanilla", "hf", "pld"] == _banner_methods(capsys.readouterr().err)


def test_plot_titles_carry_the_setting_and_loaded_methods_are_flagged(bench_result, tmp_path, monkeypatch):
    res, _ = bench_result
    labels = [m["label"] for m in res["run"]["methods"]]
    by = res["run"]["contention"]["by_method"]
    assert set(by) == set(labels) and all(f is None or 0.0 <= f <= 1.0 for f in by.values())
    busy = next(m for m in labels if m != res["run"]["baseline"] and m not in ("vanilla", "hf"))
    run = dict(res["run"], contention={"other_cpu_frac": 0.02, "by_method": {m: 0.0 for m in labels} | {busy: 0.3}})
    plots = {}

    def finish(plt, fig, ax, title, path):
        plots[path.name] = (title, ax.get_legend_handles_labels()[1])
        plt.close(fig)

    monkeypatch.setattr(report, "_finish", finish)
    report.plot_all(tmp_path, run, res["summary"])
    assert set(plots) == set(report.PLOTS)
    for title, _ in plots.values():
        assert "T=0" in title and "max 16 new tokens" in title and "2 questions" in title, title
    legend = plots["speedup_by_category.png"][1]
    assert f"{busy} (other load 30%)" in legend and not any("other load" in x for x in legend if busy not in x)
    md = report.render(run, res["summary"], res["audit"])
    speed = md.split("## Speedup vs")[1].split("## Tokens per second")[0]
    assert f"`{busy}` ⚠" in speed and f"`{busy}` 30% of the CPUs" in speed and speed.count("⚠") == 2
    # the baseline's load moves every speedup
    run["contention"]["by_method"] = {m: 0.0 for m in labels} | {res["run"]["baseline"]: 0.2}
    assert set(report.loaded(run)) == set(labels) - {res["run"]["baseline"]}
    run["contention"]["by_method"] = {m: 0.01 for m in labels}
    assert report.loaded(run) == {} and "⚠" not in report.render(run, res["summary"], res["audit"])


def test_progress_bar_names_the_turn(bench_models, monkeypatch):
    target, tok, _ = bench_models
    posts = []

    class Bar:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def set_postfix_str(self, s, refresh=True):
            posts.append(s)

        def update(self, n=1):
            pass

    monkeypatch.setattr(runner, "_progress", lambda total, enabled: Bar())
    cfg = BenchConfig(parse_methods("vanilla", False), max_new_tokens=3, warmup=0, threads=1)
    run_bench(cfg, [Question("81", "writing", ["Hi.", "More."])], target, tok)
    assert posts and all(re.fullmatch(r"q=81 turn=[01] \S+", p) for p in posts), posts
    assert {p.split()[1] for p in posts} == {"turn=0", "turn=1"}
