"""The benchmark end to end on random tiny models with an offline char-level tokenizer: every report
file, the audit catching a corrupted output, compare, and CLI errors."""

import json

import pytest
import torch

from specdec.bench.audit import audit, audit_groups, first_divergence
from specdec.bench.methods import parse_methods
from specdec.bench.report import PLOTS
from specdec.bench.runner import BenchConfig, run_bench
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.machine import weight_bytes_per_token
from tests.helpers import QS, char_tokenizer, noisy_copy


def test_end_to_end_writes_every_file(bench_result, bench_models):
    res, out = bench_result
    for f in ["report.md", "run.json", "summary.json", "audit.json"] + [f"plots/{p}" for p in PLOTS]:
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    for p in PLOTS:
        assert (out / "plots" / p).read_bytes()[:4] == b"\x89PNG"
    labels = [m["label"] for m in res["run"]["methods"]]
    assert labels == ["vanilla", "hf", "sps:gamma=3", "sps-tree:topk=2:gamma=3:tree_tokens=6", "hf-pld:num_tokens=4",
                      "hf-assisted"]
    raw = {p.name for p in (out / "raw").iterdir()}
    assert len(raw) == len(labels)
    # 3 prompts (2 turns + 1) x 2 repeats per method
    lines = [json.loads(x) for x in (out / "raw" / "sps_gamma=3.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and {(x["question_id"], x["turn"]) for x in lines} == {("81", 0), ("81", 1), ("7", 0)}
    # round-robin: the first method differs between prompts
    firsts = {(r["question_id"], r["turn"], r["repeat"]): r["method"] for r in res["records"] if r["order"] == 0}
    assert len(set(firsts.values())) > 1
    s = res["summary"]
    assert set(s["vanilla"]) == {"writing", "qa", "overall"}
    assert s["vanilla"]["overall"]["tau"] == 1.0
    tree = s["sps-tree:topk=2:gamma=3:tree_tokens=6"]["overall"]
    assert tree["calibration"] and 1 <= tree["tau"] <= 4 and "expected_improvement" in tree
    assert res["run"]["baseline"] in ("hf", "vanilla")
    assert res["run"]["machine"]["torch_threads"] >= 1 and res["run"]["machine"]["cpu"]
    assert res["run"]["floor"]["weight_mb"] == weight_bytes_per_token(bench_models[0]) / 1e6
    other = res["run"]["contention"]["other_cpu_frac"]
    assert other is None or 0.0 <= other <= 1.0
    md = (out / "report.md").read_text()
    for section in ("## Speedup vs", "## τ", "## Acceptance by depth", "## Leviathan analysis",
                    "## Losslessness audit", "## Time split", "prefill excluded", "plots/calibration.png",
                    "## Against the memory floor"):
        assert section in md, section


def test_lossless_outputs_pass_the_audit(bench_result):
    res, _ = bench_result
    aud = res["audit"]
    assert aud["checked"] == 6 * 6 - 3  # every generation except the reference's own first repeat
    assert aud["ok"], aud["mismatches"]
    # second turns use vanilla's own first answer: same prompt length for every method
    t1 = {r["prompt_tokens"] for r in res["records"] if r["turn"] == 1}
    assert len(t1) == 1


def test_audit_catches_a_corrupted_output(bench_models, bench_result):
    target, tok, _ = bench_models
    res, _ = bench_result
    recs = [dict(r) for r in res["records"] if r["method"] in ("vanilla", "sps:gamma=3")]
    prompts = res["prompts"]
    bad = next(r for r in recs if r["method"] == "sps:gamma=3" and r["question_id"] == "7")
    pos = 5
    ref_tok = bad["tokens"][pos]
    logits = target(torch.tensor([prompts[("7", 0)] + bad["tokens"][:pos]])).logits[0, -1]
    wrong = int(logits.argsort()[0])  # the target's least likely token: certainly not a tie
    bad["tokens"] = bad["tokens"][:pos] + [wrong] + bad["tokens"][pos + 1:]
    aud = audit(recs, prompts, target)
    assert not aud["ok"] and aud["bugs"] == 1
    m = aud["mismatches"][0]
    assert (m["method"], m["question_id"], m["position"]) == ("sps:gamma=3", "7", pos)
    assert m["reference_token"] == ref_tok and m["method_token"] == wrong
    assert m["verdict"] == "bug" and m["top2_gap"] > 0 and m["argmax"] == ref_tok


def test_audit_calls_a_near_tie_a_tie(bench_models):
    target, _, _ = bench_models
    prompt = [5, 6, 7]
    logits = target(torch.tensor([prompt])).logits[0, -1]
    t1, t2 = logits.topk(2).indices.tolist()
    with torch.no_grad():  # force an exact tie between the top-2 at this position
        b = target.lm_head.weight
        saved = b[t2].clone()
        h = target.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        b[t2] += (h * (logits[t1] - logits[t2]) / (h @ h))
    try:
        recs = [{"method": "vanilla", "question_id": "q", "turn": 0, "repeat": 0, "tokens": [t1, 3]},
                {"method": "x", "question_id": "q", "turn": 0, "repeat": 0, "tokens": [t2, 3]}]
        aud = audit(recs, {("q", 0): prompt}, target)
        assert aud["ok"] and aud["ties"] == 1 and aud["mismatches"][0]["verdict"] == "tie"
    finally:
        with torch.no_grad():
            target.lm_head.weight[t2] = saved


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_compare_and_report_rebuild(bench_result, tmp_path, capsys):
    from specdec.bench.report import rebuild

    _, out = bench_result
    before = (out / "report.md").read_text()
    assert rebuild(out).read_text() == before  # the JSON files alone regenerate the report
    assert main(["bench", "compare", str(out), str(out), "--out", str(tmp_path / "cmp.md")]) == 0
    text = capsys.readouterr().out
    assert "| `sps:gamma=3` | **overall** |" in text and "+0%" in text
    assert (tmp_path / "cmp.md").read_text() == text
    assert main(["bench", "compare", str(out), str(tmp_path)]) == 2
    assert "not a `specdec bench` results directory" in capsys.readouterr().err


def test_merge_keeps_the_prompts_every_method_completed(bench_result, tmp_path, capsys):
    import shutil

    _, out = bench_result
    part = tmp_path / "part"  # a second part with one method's records of question 7 missing
    shutil.copytree(out / "raw", part / "raw")
    f = part / "raw" / "hf-assisted.jsonl"
    f.write_text("".join(x + "\n" for x in f.read_text().splitlines() if json.loads(x)["question_id"] != "7"))
    for p in (part / "raw").iterdir():  # disjoint prompts from the first part: the part's ids renamed
        p.write_text("".join(json.dumps({**json.loads(x), "question_id": "p" + json.loads(x)["question_id"]}) + "\n"
                             for x in p.read_text().splitlines()))
    assert main(["bench", "merge", str(out), str(part), "--out", str(tmp_path / "m.md")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("5 prompts, 6 methods")  # 3 + 2: p7 dropped for every method
    assert "| `vanilla` |" in text and "(reference)" in text and "| `sps:gamma=3` |" in text
    assert (tmp_path / "m.md").read_text() == text
    assert main(["bench", "merge", str(out), str(tmp_path / "missing")]) == 2
    assert "missing' is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--methods", "vanilla,warp9"], "unknown method 'warp9'"),
    (["--categories", "poetry"], "unknown category 'poetry'"),
    (["--methods", "sps:gamma"], "expected key=value"),
    (["--methods", "pld:weights=int3"], "weights"),
    (["--methods", "hf:weights=int8"], "only our methods take it"),
    (["--temperatures", "0,warm"], "--temperatures: 'warm' is not a temperature"),
    (["--temperatures", "0,-1"], "--temperatures: '-1' is not a temperature"),
    (["--temperatures", "0,1,1.0"], "names a temperature twice"),
    (["--temperature", "1", "--temperatures", "0,1"], "not both"),
    (["--per-task", "1", "--quick"], "choose one of --per-category, --per-task and --quick"),
    (["--per-task", "1", "--last", "3"], "--last cannot be combined"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, argv, msg):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["x"]}) + "\n")
    assert main(["bench", "--questions", str(q), "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and msg in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bad_method_option_fails_before_timing(bench_models):
    target, tok, _ = bench_models
    from specdec.errors import SpecdecError

    cfg = BenchConfig(parse_methods("vanilla,hf-pld:bogus_field=3", False), max_new_tokens=4, progress=False)
    with pytest.raises(SpecdecError, match="bogus_field"):
        run_bench(cfg, QS[1:], target, tok)
    with pytest.raises(SpecdecError, match="unknown option"):  # our methods: already when the spec is parsed
        cfg = BenchConfig(parse_methods("sps:gamma=2:warp=1", True), max_new_tokens=4, progress=False)
        run_bench(cfg, QS[1:], target, tok, target, tok)
    for bad in ({"timing": "fastest"}, {"interleave": "token"}):  # before any method is built
        with pytest.raises(SpecdecError, match="timing must be 'mean' or 'best' and interleave"):
            run_bench(BenchConfig(parse_methods("vanilla", True), max_new_tokens=4, progress=False, **bad),
                      QS[1:], target, tok)


def test_sampled_run_audits_by_greedy_replay(bench_models):
    target, tok, draft = bench_models
    cfg = BenchConfig(parse_methods("sps:gamma=2", True), max_new_tokens=8, temperature=0.8, warmup=0,
                      progress=False, threads=1, audit_questions=1)
    res = run_bench(cfg, QS[1:], target, tok, draft, tok)
    assert res["audit"]["mode"].startswith("greedy replay of 1 prompt")
    assert res["audit"]["ok"] and res["audit"]["checked"] == 2
    assert {r["method"] for r in res["records"]} == {"vanilla", "hf", "sps:gamma=2"}


def test_cli_quick_path_with_a_tiny_model(bench_models, tmp_path, monkeypatch, capsys):
    target, tok, _ = bench_models
    import specdec.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["Hi?", "And then?"]}) + "\n"
                         for i, c in enumerate(["qa", "qa", "rag"])))
    out = tmp_path / "res"
    rc = main(["bench", "--quick", "--questions", str(q), "--methods", "vanilla,hf", "--max-new-tokens", "6",
               "--threads", "1", "--no-progress", "--out", str(out), "--first-turn"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "losslessness audit: PASS" in text and str(out / "report.md") in text
    run = json.loads((out / "run.json").read_text())
    assert run["questions"] == 2 and run["config"]["extra"]["quick"]  # one per category
    assert run["generations"] == 2 * 2  # --first-turn: 2 questions x 2 methods, second turns dropped
    assert run["command"].startswith("specdec ")


def test_a_preset_runs_every_temperature_in_one_process_and_flags_win(bench_models, tmp_path, monkeypatch, capsys):
    target, tok, _ = bench_models
    import specdec.bench.cli as bench_cli

    loads = []
    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: loads.append(spec) or (target, tok, None))
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["Hi?", "And then?"]}) + "\n"
                         for i, c in enumerate(["qa", "qa", "rag", "writing", "math"])))
    out = tmp_path / "res"
    # the preset's methods and token count give way to the command line's; its subset, demo and T list stay
    rc = main(["bench", "--preset", "adaptive", "--questions", str(q), "--methods", "vanilla,hf", "--max-new-tokens",
               "5", "--threads", "1", "--no-progress", "--out", str(out)])
    assert rc == 0 and len(loads) == 1
    text = capsys.readouterr().out
    assert text.count("losslessness audit: PASS") == 2
    for t in (0, 1):
        run = json.loads((out / f"T{t}" / "run.json").read_text())
        assert run["config"]["temperature"] == t and run["config"]["max_new_tokens"] == 5
        assert run["config"]["extra"]["preset"] == "adaptive"
        # the demo prompt + 5 per task: both qa, rag, and the MT-bench rows (writing, math) as one task
        assert run["questions"] == 6 and run["generations"] == 6 * 2  # first turns only
    raw = (out / "T0" / "raw").iterdir()
    assert any("demo" in json.dumps(json.loads(line)) for f in raw for line in f.read_text().splitlines())


def test_report_flags_a_contended_run(bench_result):
    from specdec.bench.report import render

    res, _ = bench_result
    run = dict(res["run"], contention={"other_cpu_frac": 0.4})
    assert "Warning: other processes used 40% of the CPUs" in render(run, res["summary"], res["audit"])
    run = dict(res["run"], contention={"other_cpu_frac": 0.0})
    assert "Warning" not in render(run, res["summary"], res["audit"])


def test_specbench_answer_files_recompute_our_speed(bench_result):
    """The fields Spec-Bench's evaluation/speed.py reads, and its formula, give our numbers back."""
    res, out = bench_result
    files = {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in (out / "specbench").iterdir()}
    assert set(files) == {p.stem for p in (out / "raw").iterdir()}
    recs = [r for r in res["records"] if r["repeat"] == 0]
    for lines in files.values():
        assert {x["question_id"] for x in lines} == {"81", "7"} and all(x["category"] for x in lines)
    van = {x["question_id"]: x["choices"][0] for x in files["vanilla"]}
    assert van["81"]["new_tokens"] == [len(r["tokens"]) for r in sorted(
        (r for r in recs if r["method"] == "vanilla" and r["question_id"] == "81"), key=lambda r: r["turn"])]
    assert len(van["81"]["turns"]) == 2 and all(isinstance(t, str) for t in van["81"]["turns"])
    speed = sum(sum(c["new_tokens"]) / sum(c["wall_time"]) for c in van.values()) / len(van)  # speed.py's mean
    ours = {q: [r for r in recs if r["method"] == "vanilla" and r["question_id"] == q] for q in van}
    want = sum(sum(len(r["tokens"]) for r in rs) / sum(r["wall_time"] for r in rs) for rs in ours.values()) / 2
    assert speed == pytest.approx(want)
    assert set(sum((c["accept_lengths"] for c in van.values()), [])) == {1}
    for c in (x["choices"][0] for x in files["sps_gamma=3"]):
        assert sum(c["decoding_steps"]) == len(c["accept_lengths"]) + len(c["turns"])  # + one prefill per turn
        assert sum(c["accept_lengths"]) + len(c["turns"]) >= sum(c["new_tokens"])  # the last step may be cut


def test_a_method_on_its_own_weights_is_audited_against_the_vanilla_of_that_precision(bench_models):
    target, tok, _ = bench_models
    specs = parse_methods("vanilla,pld:num_tokens=3,pld:num_tokens=3:weights=int8", False)
    assert [s.label for s in specs][:3] == ["vanilla", "hf", "vanilla:weights=int8"]  # its reference, added
    cfg = BenchConfig(specs, max_new_tokens=12, warmup=0, progress=False, threads=1)
    res = run_bench(cfg, QS, target, tok)
    aud, run = res["audit"], res["run"]
    assert aud["ok"], aud["mismatches"]
    assert aud["references"] == {"pld:num_tokens=3": "vanilla", "hf": "vanilla",
                                 "pld:num_tokens=3:weights=int8": "vanilla:weights=int8"}
    prec = {m["label"]: m.get("precision") for m in run["methods"]}
    assert prec["vanilla"] == "fp32" and prec["pld:num_tokens=3:weights=int8"] == "int8"
    assert run["floors"]["int8"]["weight_mb"] < run["floors"]["fp32"]["weight_mb"] / 2
    by = {(r["method"], r["question_id"], r["turn"]): r["tokens"] for r in res["records"]}
    for (m, q, t), toks in by.items():  # the int8 method emits exactly the int8 vanilla's tokens
        if m == "pld:num_tokens=3:weights=int8":
            assert toks == by[("vanilla:weights=int8", q, t)]
    # the int8 target's agreement with the fp32 one is reported, not audited
    assert set(aud["agreement"]) >= {"vanilla:weights=int8", "pld:num_tokens=3:weights=int8"}


def test_a_method_on_its_own_target_is_audited_against_that_targets_vanilla(bench_models, tmp_path):
    """target=DIR (e.g. a Medusa-2 run's new target): the method runs on that model, its vanilla is added as
    its reference, and a wrong tokenizer or a missing directory is one line before any model loads."""
    target, tok, _ = bench_models
    other = noisy_copy(target, 0.5)  # a different model on the same tokenizer
    other.save_pretrained(tmp_path / "new")
    tok.save_pretrained(tmp_path / "new")
    d = str((tmp_path / "new").resolve())
    specs = parse_methods(f"vanilla,pld:num_tokens=3,pld:num_tokens=3:target={tmp_path / 'new'}", False)
    assert [s.label for s in specs][:3] == ["vanilla", "hf", f"vanilla:target={d}"]
    cfg = BenchConfig(specs, max_new_tokens=12, warmup=0, progress=False, threads=1)
    res = run_bench(cfg, QS, target, tok)
    aud, run = res["audit"], res["run"]
    mine = f"pld:num_tokens=3:target={tmp_path / 'new'}"
    assert aud["ok"], aud["mismatches"]
    assert aud["references"][mine] == f"vanilla:target={d}" and aud["references"]["pld:num_tokens=3"] == "vanilla"
    assert {m["label"]: m.get("target") for m in run["methods"]}[mine] == d
    by = {(r["method"], r["question_id"], r["turn"]): r["tokens"] for r in res["records"]}
    same = [by[(mine, q, t)] == by[(f"vanilla:target={d}", q, t)] for (m, q, t) in by if m == mine]
    differ = [by[(mine, q, t)] != by[("vanilla", q, t)] for (m, q, t) in by if m == mine]
    assert all(same) and any(differ)  # the other target's text, not the run model's
    assert aud["agreement"][f"vanilla:target={d}"]["compared"] > 0  # how far it is from the run's target
    for bad, msg in ((f"pld:target={tmp_path / 'none'}", "not a model directory"),
                     (f"hf:target={d}", "only our methods take it")):
        with pytest.raises(SpecdecError, match=msg):
            parse_methods(bad, False)
    tok2 = char_tokenizer()
    tok2.add_tokens(["<extra>"])
    tok2.save_pretrained(tmp_path / "new")
    with pytest.raises(SpecdecError, match="its tokenizer is not the run's"):
        run_bench(cfg, QS, target, tok)


def test_audit_groups_hold_each_method_to_its_own_reference(bench_models):
    target, _, _ = bench_models
    prompt = [3, 4, 5]
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    other = ref[:2] + [(ref[2] + 1) % 50] + ref[3:]  # "another precision's" text, leaving ref at token 2
    wrong = other[:4] + [(other[4] + 1) % 50] + other[5:]
    recs = [{"method": m, "question_id": "q", "turn": 0, "repeat": 0, "tokens": t}
            for m, t in [("vanilla", ref), ("a", ref), ("v8", other), ("b", other)]]

    def logits8(ids):  # a stand-in target for the other precision: its argmax is `other`, clearly
        out = torch.zeros(target.config.vocab_size)
        out[other[len(ids) - len(prompt)]] = 10.0
        return out

    groups = {"vanilla": (["a"], target), "v8": (["b"], logits8)}
    aud = audit_groups(recs, {("q", 0): prompt}, groups)
    assert aud["ok"] and aud["checked"] == 2 and aud["references"] == {"a": "vanilla", "b": "v8"}
    assert aud["agreement"]["b"]["first_divergence_min"] == 2  # reported against the main reference
    recs[3]["tokens"] = wrong
    aud = audit_groups(recs, {("q", 0): prompt}, groups)
    assert not aud["ok"] and aud["bugs"] == 1
    bad = aud["mismatches"][0]
    assert (bad["method"], bad["reference"], bad["position"]) == ("b", "v8", 4)


def test_a_peer_failing_on_one_prompt_costs_that_prompt_not_the_run(bench_models, monkeypatch, tmp_path):
    """llama-cpp-python's prompt lookup once crashed on one MT-bench prompt after 37 minutes of a run."""
    import specdec.bench.runner as runner_mod

    target, tok, _ = bench_models
    real = runner_mod.build_peer

    class Flaky:
        def __init__(self, inner):
            self.spec, self.inner = inner.spec, inner

        def run(self, ids, temperature, seed, max_new):
            if tok.decode(ids).count("poem"):
                raise ValueError("could not broadcast input array")
            return self.inner.run(ids, temperature, seed, max_new)

    monkeypatch.setattr(runner_mod, "build_peer", lambda spec, *a, **k: Flaky(real(spec, *a, **k)))
    cfg = BenchConfig(parse_methods("vanilla,pld:num_tokens=3", False), max_new_tokens=6, warmup=0, progress=False,
                      threads=1)
    res = run_bench(cfg, QS, target, tok, out_dir=tmp_path / "o")
    assert {(r["question_id"], r["turn"]) for r in res["records"]} == {("7", 0)}  # q 81 gone for every method
    (skip,) = res["run"]["skipped"]
    assert (skip["question_id"], skip["turn"]) == ("81", 0) and "hf failed on it (ValueError" in skip["reason"]
    assert res["audit"]["ok"] and res["summary"]["pld:num_tokens=3"]["overall"]["n"] == 1
    raw = (tmp_path / "o" / "raw" / "vanilla.jsonl").read_text().splitlines()
    assert len(raw) == 1 and json.loads(raw[0])["question_id"] == "7"
    assert "81/turn 0 (hf failed on it" in (tmp_path / "o" / "report.md").read_text()


def test_lockstep_steps_each_run_in_turn_until_all_are_done():
    from specdec.bench.ours import lockstep

    seen = []

    def run(name, steps):
        for i in range(steps):
            seen.append((name, i))
            yield
        return {"name": name, "steps": steps}

    out = lockstep({"a": run("a", 3), "b": run("b", 1), "c": run("c", 2)})
    assert out == {"a": {"name": "a", "steps": 3}, "b": {"name": "b", "steps": 1}, "c": {"name": "c", "steps": 2}}
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_methods_stepping_in_turn_give_the_tokens_they_give_alone(bench_models, temperature, monkeypatch):
    """--interleave step: our methods advance a step each in turn (a peer runs on its own after them); every
    output is what the same method gives run whole, each method's wall time counts only its own steps."""
    target, tok, draft = bench_models
    kw = dict(max_new_tokens=12, temperature=temperature, warmup=0, progress=False, threads=1, repeats=2)
    methods = parse_methods("sps:gamma=3,pld:chain_len=4", True)
    whole = run_bench(BenchConfig(methods, **kw), QS[1:], target, tok, draft, tok)
    import specdec.bench.runner as R
    from specdec.bench.ours import lockstep

    groups = []
    monkeypatch.setattr(R, "lockstep", lambda runs: groups.append(sorted(runs)) or lockstep(runs))
    step = run_bench(BenchConfig(methods, interleave="step", timing="best", **kw), QS[1:], target, tok, draft, tok)
    key = lambda r: (r["method"], r["question_id"], r["turn"], r["repeat"])  # noqa: E731
    assert {key(r): r["tokens"] for r in step["records"]} == {key(r): r["tokens"] for r in whole["records"]}
    assert step["audit"]["ok"] and step["run"]["config"]["interleave"] == "step"
    for r in step["records"]:
        assert r["wall_time"] > 0 and (r["stats"] is None or r["stats"]["time"]["total"] == r["wall_time"])
    assert set(step["summary"]["sps:gamma=3"]) >= {"overall"}
    assert groups and all(g == ["pld:chain_len=4", "sps:gamma=3", "vanilla"] for g in groups)  # the peer apart


def test_each_of_our_methods_gets_its_own_peak_rss(bench_models, monkeypatch, tmp_path):
    """The process's peak is restarted before each of our generations: what one method allocated while it ran
    shows in its peak, not in the next method's."""
    from specdec.bench.ours import OurMethod

    target, tok, draft = bench_models
    run = OurMethod.run

    def hungry(self, *a, **k):
        if self.spec.name == "sps":
            big = torch.ones(300_000_000 // 4)  # 300 MB, touched
            assert big.sum() > 0
            del big
        return run(self, *a, **k)

    monkeypatch.setattr(OurMethod, "run", hungry)
    # two repeats: the second runs vanilla after sps (the order rotates), where a peak carried over would show
    cfg = BenchConfig(parse_methods("sps:gamma=2", True), max_new_tokens=4, warmup=0, progress=False, threads=1,
                      repeats=2)
    res = run_bench(cfg, QS[1:], target, tok, draft, tok, out_dir=tmp_path / "out")
    assert [r["method"] for r in res["records"]][-1] == "vanilla"
    peak = {m["label"]: m.get("peak_rss_mb") for m in res["run"]["methods"]}
    assert peak["hf"] is None  # in-process HF: not read on its own
    assert peak["sps:gamma=2"] - peak["vanilla"] > 250
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Peak RSS, MB" in md and f"| `vanilla` | {peak['vanilla']:.0f} |" in md


def test_a_peer_failing_in_the_warm_up_stops_the_run_with_one_line(bench_models, monkeypatch, tmp_path, capsys):
    """A peer that fails before anything is timed (llama-server aborting on a draft it cannot run) would fail
    every prompt: one clear line naming it, before any timing, and its server stopped."""
    import specdec.bench.runner as runner_mod

    target, tok, _ = bench_models
    real, closed = runner_mod.build_peer, []

    class Broken:
        def __init__(self, inner, closers):
            self.spec, self.inner = inner.spec, inner
            closers.callback(lambda: closed.append(True))

        def run(self, ids, temperature, seed, max_new):
            raise ConnectionError("Remote end closed connection without response")

    monkeypatch.setattr(runner_mod, "build_peer", lambda spec, *a, **k: Broken(real(spec, *a, **k), k["closers"]))
    cfg = BenchConfig(parse_methods("vanilla,pld:num_tokens=3", False), max_new_tokens=6, warmup=1, progress=False,
                      threads=1)
    with pytest.raises(SpecdecError, match=r"hf failed on it \(ConnectionError.* in the warm-up, before any timing"):
        run_bench(cfg, QS, target, tok, out_dir=tmp_path / "o")
    assert closed == [True] and not (tmp_path / "o" / "raw").exists()
