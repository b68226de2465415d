"""Benchmark arithmetic on synthetic traces, method-spec parsing, and question-file errors (no models)."""

import gzip
import json
import math

import pytest
import torch

from specdec.bench import metrics as M
from specdec.bench.data import Question, first_per_category, load_questions, quick_subset, read_jsonl
from specdec.bench.methods import parse_method, parse_methods
from specdec.errors import SpecdecError
from specdec.stats import Stats
from specdec.tree import DraftTree

KNOWN = ("vanilla", "sps", "sps-tree", "eagle2", "hf", "hf-pld", "hf-assisted")


def chain(n):
    return DraftTree.chain(torch.arange(n) + 10)


def test_tau_and_alpha_from_engine_stats():
    s = Stats()
    # chain of 4: accepted 4, 2, 0, 1 tokens
    for acc in (4, 2, 0, 1):
        s.record(chain(4), list(range(acc)))
    assert s.accept_lengths == [5, 3, 1, 2]
    assert M.tau_from_histogram(s.accept_histogram()) == pytest.approx(11 / 4) == pytest.approx(s.tau)
    # depth 1 tried 4x accepted 3x; depth 2 tried 3x accepted 2x; depth 3 tried 2x acc 1x; depth 4 1/1
    assert s.depth_tries == [4, 3, 2, 1] and s.depth_accepts == [3, 2, 1, 1]
    assert M.alpha_by_depth(s.depth_tries, s.depth_accepts) == pytest.approx([0.75, 2 / 3, 0.5, 1.0])
    assert M.mean_alpha(s.depth_tries, s.depth_accepts) == pytest.approx(7 / 10)


def test_tree_depth_accounting():
    # root has children 0 and 1; node 0 has child 2; accept 0 then 2: two depths tried, both accepted
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]))
    s = Stats()
    s.record(tree, [0, 2])
    s.record(tree, [1])  # node 1 has no child: depth 2 not tried
    assert s.depth_tries == [2, 1] and s.depth_accepts == [2, 1]
    assert s.accept_histogram() == {3: 1, 2: 1}


def test_merge_and_sum():
    assert M.merge_histograms([{1: 2, "3": 1}, {"1": 1, 2: 4}]) == {1: 3, 2: 4, 3: 1}
    assert M.sum_lists([[1, 2], [3], [0, 0, 5]]) == [4, 2, 5]
    assert M.tau_from_histogram({}) == 0.0


def test_expected_improvement_formula():
    a, g, c = 0.8, 4, 0.1
    assert M.expected_tau(a, g) == pytest.approx((1 - 0.8**5) / 0.2)
    assert M.expected_improvement(a, g, c) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert M.expected_improvement(a, g, c) == pytest.approx(2.4011428571)
    assert M.expected_improvement(1.0, 3, 0.0) == pytest.approx(4.0)  # α → 1 limit
    assert M.expected_improvement(0.0, 3, 0.5) == pytest.approx(1 / 2.5)  # nothing accepted: pure cost
    assert M.cost_ratio(2.0, 100, 0.05) == pytest.approx(0.4)
    assert math.isnan(M.cost_ratio(1.0, 0, 0.05))


def test_speedup_mean_std_and_calibration():
    assert M.speedup([2.0, 2.0], [1.0, 1.0]) == 2.0
    # sampled outputs differ in length: per-token time decides (same time, twice the tokens = 2x)
    assert M.speedup([2.0, 2.0], [2.0, 2.0], [10, 10], [20, 20]) == 2.0
    assert M.speedup([2.0], [1.0], [10], [5]) == 1.0
    m, s = M.mean_std([2.0, 4.0])
    assert m == 3.0 and s == pytest.approx(math.sqrt(2))
    assert M.mean_std([1.5]) == (1.5, 0.0)
    cal = M.calibration_curve([(0.05, False), (0.95, True), (0.91, False), (1.0, True)], bins=10)
    assert [(b["lo"], b["n"]) for b in cal] == [(0.0, 1), (0.9, 3)]
    assert cal[1]["acceptance"] == pytest.approx(2 / 3)
    assert cal[1]["confidence"] == pytest.approx((0.95 + 0.91 + 1.0) / 3)


def _rec(method, qid, cat, rep, wall, tokens=10, stats=None):
    return {"method": method, "name": method, "question_id": qid, "category": cat, "turn": 0, "repeat": rep,
            "wall_time": wall, "new_tokens": tokens, "stats": stats}


def _st(hist, tries, accepts, draft, verify, fwd, gamma=4):
    return {"target_forwards": fwd, "accept_histogram": hist, "depth_tries": tries, "depth_accepts": accepts,
            "gamma": gamma, "time": {"total": draft + verify + 0.1, "prefill": 0.1, "draft": draft,
                                     "verify": verify, "overhead": 0.0}}


def test_summarize_baseline_speedup_and_leviathan():
    van = _st({1: 10}, [], [], 0.0, 1.0, 10)  # 0.1 s per target forward
    spec = _st({3: 4, 1: 2}, [6, 4], [4, 4], 0.4, 0.6, 6)
    recs = []
    for rep, scale in ((0, 1.0), (1, 1.1)):
        recs += [_rec("hf", "a", "x", rep, 3.0 * scale), _rec("hf", "b", "y", rep, 3.0 * scale),
                 _rec("vanilla", "a", "x", rep, 2.0 * scale, stats=van), _rec("vanilla", "b", "y", rep, 2.0, stats=van),
                 _rec("sps", "a", "x", rep, 1.0, stats=spec), _rec("sps", "b", "y", rep, 0.5, stats=spec)]
    base = M.choose_baseline(recs)
    assert base == "vanilla"  # faster in total than hf
    longer_hf = [dict(r, new_tokens=40) if r["method"] == "hf" else r for r in recs]
    assert M.choose_baseline(longer_hf) == "hf"  # more tokens in its 3 s: faster per token
    s = M.summarize(recs, base)
    # repeat 0: x 2/1, y 2/0.5; repeat 1: x 2.2/1
    assert s["sps"]["x"]["speedup"] == pytest.approx((2.0 + 2.2) / 2)
    assert s["sps"]["x"]["speedup_std"] == pytest.approx(math.sqrt(0.02))
    assert s["sps"]["y"]["speedup"] == pytest.approx(4.0)
    assert s["sps"][M.OVERALL]["speedup"] == pytest.approx(((4.0 / 1.5) + (4.2 / 1.5)) / 2)
    assert s["vanilla"][M.OVERALL]["speedup"] == pytest.approx(1.0)
    assert s["hf"]["x"]["speedup"] == pytest.approx(2 / 3)
    o = s["sps"][M.OVERALL]
    assert o["tau"] == pytest.approx(14 / 6)
    assert o["alpha_by_depth"] == pytest.approx([4 / 6, 1.0])
    assert o["alpha"] == pytest.approx(0.8)
    # c = (0.4 s / (6 forwards * 4 steps)) / 0.1 s
    assert o["cost_ratio"] == pytest.approx((0.4 / 24) / 0.1)
    assert o["expected_improvement"] == pytest.approx(M.expected_improvement(0.8, 4, (0.4 / 24) / 0.1))
    assert o["time_split"]["draft_frac"] == pytest.approx(0.4 / 1.1)
    assert o["tokens_per_s"] == pytest.approx(20 / 1.5)
    assert "tau" not in s["hf"][M.OVERALL]


def test_best_timing_keeps_each_methods_fastest_repeat_per_prompt():
    """A repeat slowed by another process does not move a prompt's ratio: per method and prompt only the
    fastest repeat counts (each method's own, not the other method's on the same repeat)."""
    recs = [_rec("vanilla", "a", "x", 0, 2.0), _rec("vanilla", "a", "x", 1, 3.0), _rec("vanilla", "a", "x", 2, 2.2),
            _rec("auto", "a", "x", 0, 1.8), _rec("auto", "a", "x", 1, 1.5), _rec("auto", "a", "x", 2, 4.0),
            _rec("vanilla", "b", "y", 0, 1.0), _rec("auto", "b", "y", 0, 1.25)]
    best = M.fastest_repeats(recs)
    assert sorted((r["method"], r["question_id"], r["wall_time"], r["repeat"]) for r in best) == [
        ("auto", "a", 1.5, 0), ("auto", "b", 1.25, 0), ("vanilla", "a", 2.0, 0), ("vanilla", "b", 1.0, 0)]
    s = M.summarize(best, "vanilla")
    assert s["auto"]["x"]["speedup"] == pytest.approx(2.0 / 1.5)
    assert s["auto"]["x"]["speedup_std"] == 0.0
    assert s["auto"][M.OVERALL]["speedup"] == pytest.approx(3.0 / 2.75)
    assert M.summarize(recs, "vanilla")["auto"]["x"]["speedup"] == pytest.approx((2.0 / 1.8 + 3.0 / 1.5 + 2.2 / 4) / 3)


def test_a_speculating_peer_gets_tokens_per_forward_from_its_accepted_drafts():
    recs = [_rec("vanilla", "a", "x", 0, 2.0, stats=_st({1: 10}, [], [], 0.0, 1.0, 10))]
    for q, acc in (("a", 6), ("b", 3)):  # 11 tokens each: 10 decoded in 4 and 7 forwards
        recs.append(dict(_rec("llama", q, "x", 0, 1.0, tokens=11), peer_stats={"draft_n": 12, "draft_n_accepted": acc}))
    recs.append(dict(_rec("llama-plain", "a", "x", 0, 1.0), peer_stats={"predicted_ms": 9.0}))
    s = M.summarize(recs, "vanilla")
    assert s["llama"][M.OVERALL]["peer_tau"] == pytest.approx(20 / 11)
    assert "tau" not in s["llama"][M.OVERALL] and "peer_tau" not in s["llama-plain"][M.OVERALL]


# --------------------------------------------------------------------------------------------- methods


def test_method_parser():
    m = parse_method("sps-tree:topk=3:gamma=4:temp=0.5:flag=true:head=/x/y", KNOWN)
    assert m.name == "sps-tree" and m.opts == {"topk": 3, "gamma": 4, "temp": 0.5, "flag": True, "head": "/x/y"}
    assert m.label == "sps-tree:topk=3:gamma=4:temp=0.5:flag=true:head=/x/y"
    specs = parse_methods("sps:gamma=4,hf-pld", True, KNOWN)
    assert [s.label for s in specs] == ["vanilla", "hf", "sps:gamma=4", "hf-pld"]
    assert [s.label for s in parse_methods(None, False, KNOWN)] == ["vanilla", "hf", "hf-pld"]
    with_pld = [s.label for s in parse_methods(None, True, KNOWN + ("pld",))]
    assert with_pld == ["vanilla", "hf", "pld", "hf-pld", "sps", "sps-tree", "hf-assisted"]


@pytest.mark.parametrize("text, msg", [
    ("medusa2", "unknown method 'medusa2'"), ("sps:gamma", "expected key=value"), ("sps:gamma=4:gamma=5", "twice"),
    ("vanilla,vanilla", "listed twice"), ("hf-assisted", "needs a draft"), (":x=1", "empty method"),
])
def test_method_parser_errors(text, msg):
    with pytest.raises(SpecdecError, match=msg):
        parse_methods(text, False, KNOWN)


def test_unknown_method_uses_the_api_list():
    with pytest.raises(SpecdecError, match="unknown method 'nope'.*vanilla"):
        parse_methods("nope", False)


# ------------------------------------------------------------------------------------------- questions


def write(tmp_path, lines, name="q.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_formats_and_filters(tmp_path):
    p = write(tmp_path, [{"question_id": 1, "category": "writing", "turns": ["a", "b"]},
                         {"question_id": 2, "category": "qa", "turns": ["c"]}, "",
                         {"question_id": 3, "category": "qa", "turns": ["d"]}])
    qs = load_questions("spec_bench", p)
    got = [(q.question_id, q.category, len(q.turns)) for q in qs]
    assert got == [("1", "writing", 2), ("2", "qa", 1), ("3", "qa", 1)]
    assert [q.question_id for q in load_questions("spec_bench", p, ["qa"], 1)] == ["2"]
    assert [q.question_id for q in load_questions("mt_bench", p)] == ["1"]
    g = write(tmp_path, [{"question": "How many?", "answer": "4"}] * 2, "g.jsonl")
    assert [(q.question_id, q.category) for q in load_questions("gsm8k", g)] == [("1", "gsm8k"), ("2", "gsm8k")]
    h = tmp_path / "h.jsonl.gz"
    with gzip.open(h, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": ""}) + "\n")
    assert read_jsonl(h)[0].category == "humaneval"


def test_installed_humaneval_and_shared_spec_bench():
    qs = load_questions("humaneval")
    assert len(qs) == 164 and qs[0].question_id == "HumanEval/0"
    try:
        sb = load_questions("spec_bench")
    except SpecdecError:
        pytest.skip("no shared Spec-Bench file next to this checkout")
    quick = quick_subset(sb)
    assert sum(len(q.turns) == 2 for q in quick) == 2
    assert len({q.category for q in quick}) == len(quick)


def test_first_per_category_keeps_file_order():
    qs = [Question(str(i), c, ["x"]) for i, c in enumerate("aabacbbc")]
    assert [q.question_id for q in first_per_category(qs, 2)] == ["0", "1", "2", "4", "5", "7"]
    assert [q.question_id for q in first_per_category(qs, 1)] == ["0", "2", "4"]


@pytest.mark.parametrize("line, msg", [
    ("{not json", "q.jsonl:2: not valid JSON"),
    ('{"question_id": 9, "category": "qa", "turns": []}', "q.jsonl:2: 'turns' must be"),
    ('{"question_id": 9, "turns": ["x"]}', "q.jsonl:2: missing 'category'"),
    ('{"question_id": 1, "category": "qa", "turns": ["x"]}', "question_id '1' appears more than once"),
    ('{"foo": 1}', "q.jsonl:2: unknown record"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_question_lines(tmp_path, line, msg):
    p = write(tmp_path, [{"question_id": 1, "category": "qa", "turns": ["x"]}, line])
    with pytest.raises(SpecdecError, match=msg):
        load_questions("spec_bench", p)


def test_question_errors(tmp_path):
    p = write(tmp_path, [{"question_id": 1, "category": "qa", "turns": ["x"]}])
    with pytest.raises(SpecdecError, match="unknown category 'math'.*has: qa"):
        load_questions("spec_bench", p, ["math"])
    with pytest.raises(SpecdecError, match="does not exist"):
        load_questions("spec_bench", tmp_path / "missing.jsonl")
    with pytest.raises(SpecdecError, match="unknown dataset"):
        load_questions("alpaca", p)
    with pytest.raises(SpecdecError, match="no MT-bench questions"):
        load_questions("mt_bench", p)
    with pytest.raises(SpecdecError, match="holds no questions"):
        load_questions("spec_bench", write(tmp_path, [""], "empty.jsonl"))


def test_calibration_pairs_only_for_tried_nodes():
    _calibration = M.calibration_pairs

    # root -> 0 (p .6), 1 (p .3); 0 -> 2 (p .5); 1 -> 3 (p .9); path accepts node 0 only
    scores = torch.log(torch.tensor([0.6, 0.3, 0.3, 0.27]))
    parents = torch.tensor([-1, -1, 0, 1])
    got = _calibration([(scores, parents, [0])])
    assert [(round(c, 3), d, ok) for c, _, d, ok in got] == [(0.6, 1, True), (0.3, 1, False), (0.5, 2, False)]
    assert got[2][1] == pytest.approx(0.3, abs=1e-4)  # V = product along the path
