"""`specdec tune`: the offline acceptance is exact for greedy, the choice, tuning.json, bad input."""

import json
import shutil
from dataclasses import asdict, astuple

import pytest
import torch

from specdec.api import from_models
from specdec.cli import main
from specdec.drafters.auto import beside_head, ngram_key
from specdec.drafters.base import NoDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.policy import EDGES
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget as Config
from specdec.tree import build_dynamic_tree
from specdec.tune.lookup import lookup_rates, node_outcomes
from specdec.tune.replay import matched_path, replay, visited
from specdec.tune.search import Row, accepted_lengths, candidates, rank, tune, walk
from specdec.tuning import BUDGET_KEYS as TUNED
from specdec.tuning import load_acceptance, load_lookup_rates, load_tuning, save_tuning, tuning_path
from tests.helpers import PROMPTS, run


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # ops this small gain nothing from a second thread, and on a busy machine two threads wait for each other
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_one_expansion_gives_every_depth_and_size():
    g = torch.Generator().manual_seed(0)
    table = torch.log_softmax(3 * torch.randn(30, 30, generator=g), -1)
    step = lambda sel, tokens, parents: torch.stack([table[int(tokens[i])] for i in sel])
    truth, prev = [], 0  # a text the trees partly guess: each token is one of the top 3 after the last
    for r in torch.randint(0, 3, (8,), generator=g).tolist():
        prev = int(torch.topk(table[prev], 3).indices[r])
        truth.append(prev)
    for k in range(1, 5):
        full = build_dynamic_tree(table[0], step, 6, k, 1 << 30)
        configs = [Config(d, k, m) for d in range(1, 7) for m in range(1, 26)]
        for budget in (1 << 30, 3):
            got = accepted_lengths(full, truth, configs, budget)
            for c in configs:
                tree = build_dynamic_tree(table[0], step, min(c.depth, budget), k, min(c.tree_size, budget))
                assert got[c] == len(matched_path(tree, truth)), (c, budget)
        # m < depth: the same tree as depth m, so candidates() leaves it out
        a, b = build_dynamic_tree(table[0], step, 5, k, 3), build_dynamic_tree(table[0], step, 3, k, 3)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert all(c.depth <= c.tree_size <= c.topk + (c.depth - 1) * c.topk ** 2 for c in candidates())
    assert Config(4, 1, 4) in candidates() and Config(4, 1, 6) not in candidates()


def test_offline_acceptance_replays_the_engine_exactly(tiny, trained):
    head = str(trained[1] / "head")
    configs = [Config(4, 3, 8), Config(3, 1, 3), Config(2, 3, 4)]
    walker = from_models(tiny, None, "eagle2", head=head)
    taus, longest = [], 0
    for prompt in PROMPTS[1:3]:
        cont, _ = run(walker.runner, NoDrafter(), prompt, SamplingParams(), 40)
        w = walk(walker.drafter, walker.runner, prompt, cont, configs)
        for c in configs:
            dec = from_models(tiny, None, "eagle2", head=head, **asdict(c))
            got, stats = run(dec.runner, dec.drafter, prompt, SamplingParams(), len(cont))
            assert got == cont
            assert replay(w.accepted[c]) == stats.accept_lengths, c
            taus.append(stats.tau)
            longest = max(longest, *stats.accept_lengths)
    assert max(taus) > 1.5 and longest >= 4  # real acceptance, deep paths (3 drafted tokens in a row) included


def test_offline_lookup_union_replays_the_engine_exactly(tiny, trained):
    """tune's model of eagle2 + a lookup chain (UnionDrafter): same accept lengths and tree sizes as
    the engine, step by step."""
    head = str(trained[1] / "head")
    configs, lookups = [Config(3, 2, 4), Config(2, 1, 2)], (2, 6)
    walker = from_models(tiny, None, "eagle2", head=head)
    grew = helped = 0
    for prompt in PROMPTS[:4]:
        cont, _ = run(walker.runner, NoDrafter(), prompt, SamplingParams(), 40)
        w = walk(walker.drafter, walker.runner, prompt, cont, configs, lookups=lookups)
        for c in configs:
            for n in lookups:
                dec = from_models(tiny, None, "eagle2", head=head, lookup=n, **asdict(c))
                got, stats = run(dec.runner, dec.drafter, prompt, SamplingParams(), len(cont))
                assert got == cont
                per_pos = w.union[(c, n)]
                steps = visited([a for a, _ in per_pos])
                assert [per_pos[i][0] + 1 for i in steps] == stats.accept_lengths, (c, n)
                assert [per_pos[i][1] for i in steps] == stats.tree_sizes, (c, n)
                grew += sum(size > c.tree_size for size in stats.tree_sizes)
                helped += replay([a for a, _ in per_pos]) != replay(w.accepted[c])
    assert grew and helped  # the chain entered the trees and changed what got accepted


def test_rank_picks_the_fastest_expected_config():
    rows = [Row(Config(2, 1, 2), 1.8, 0.002, 0.050, 0.001),  # cheapest: 34.0 tok/s
            Row(Config(4, 2, 6), 2.6, 0.006, 0.060, 0.001),  # 38.8: neither cheapest nor highest tau
            Row(Config(5, 3, 10), 2.8, 0.010, 0.065, 0.001),  # 36.8
            Row(Config(6, 4, 20), 3.0, 0.015, 0.090, 0.001)]  # highest tau: 28.3
    assert [astuple(r.config) for r in rank(rows)] == [(4, 2, 6), (5, 3, 10), (2, 1, 2), (6, 4, 20)]
    tie = [Row(Config(3, 2, 8), 2.0, 0.01, 0.04, 0.0), Row(Config(3, 2, 4), 2.0, 0.01, 0.04, 0.0)]
    assert rank(tie)[0].config.tree_size == 4  # equal speed: the smaller tree


def test_tune_writes_the_choice_and_from_target_uses_it(tiny, trained, tmp_path, monkeypatch):
    import specdec.tuning

    head = tmp_path / "head"
    shutil.copytree(trained[1] / "head", head)
    dec = from_models(tiny, None, "eagle2", head=str(head))
    configs = [Config(2, 1, 2), Config(3, 2, 4), Config(4, 3, 8)]
    rec = tune(dec, PROMPTS[:2], tokens=30, configs=configs, reps=1, time_every=8)
    best = (rec["depth"], rec["topk"], rec["tree_size"])
    assert best in [astuple(c) for c in configs] and best == tuple(rec["top"][0][k] for k in TUNED)
    assert rec["tau"] >= 1 and rec["machine"]["torch"] == torch.__version__
    assert {"1", "3", "5", "9"} <= set(rec["target_ms"])  # + the sizes trees with a lookup chain reached
    assert astuple(dec.drafter.budget) == (5, 4, 10)  # left as it was
    auto = rec["auto"]  # the fastest over plain trees and trees + a lookup chain of each length tried
    assert auto["lookup"] in (0, *rec["lookups_tried"]) and auto["tokens_per_second"] >= rec["tokens_per_second"]
    assert any(r.get("lookup") for r in rec["top_with_lookup"])
    # the acceptance model adaptive auto reads: every config's tau, the same numbers the ranking used
    assert [(r["depth"], r["topk"], r["tree_size"]) for r in rec["acceptance"]] == sorted(
        astuple(c) for c in configs)
    assert {(r["depth"], r["topk"], r["tree_size"]): r["tau"] for r in rec["top"]} == {
        (r["depth"], r["topk"], r["tree_size"]): r["tau"] for r in rec["acceptance"]}

    assert save_tuning(rec, tuning_path(head)) == head / "tuning.json"
    assert json.loads((head / "tuning.json").read_text())["top"] == rec["top"]
    assert load_tuning(head) == dict(zip(TUNED, best))
    assert load_acceptance(head) == rec["acceptance"]
    d = from_models(tiny, None, "eagle2", head=str(head)).drafter
    assert astuple(d.budget) == best
    d = from_models(tiny, None, "eagle2", head=str(head), depth=7, tree_tokens=12).drafter  # explicit wins
    assert astuple(d.budget) == (7, best[1], 12)
    # `auto` takes the "auto" choice: its tree and, when one won, the lookup chain
    rec["auto"] = {"depth": 3, "topk": 2, "tree_size": 6, "lookup": 5}
    save_tuning(rec, tuning_path(head))
    assert load_tuning(head, auto=True) == rec["auto"] and load_tuning(head) == dict(zip(TUNED, best))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # adaptive auto caches its measured costs
    a = from_models(tiny, None, "auto", head=str(head)).drafter  # adaptive (default): the tuned chain length,
    assert a.ngram.chain_len == 5 and {astuple(b) for b, _ in a.menu} <= {astuple(c) for c in configs}  # tune's table
    u = from_models(tiny, None, "auto", head=str(head), adaptive=False)  # static: tune's choice as is
    e, p = u.drafter.members
    assert u.drafter.name == "eagle2+pld" and (*astuple(e.budget), p.inner.chain_len) == (3, 2, 6, 5)
    assert from_models(tiny, None, "auto", head=str(head), lookup=0, adaptive=False).drafter.budget.depth == 3
    # the tuned chain is priced for greedy decoding: sampled requests get the EAGLE tree alone, unless
    # the caller asks for the chain
    explicit = from_models(tiny, None, "auto", head=str(head), lookup=5, adaptive=False)
    sizes = {"greedy": [], "sampled": [], "explicit": []}
    for prompt in PROMPTS[:3]:
        for key, dec, params in (("greedy", u, SamplingParams()), ("sampled", u, SamplingParams(1.0, seed=0)),
                                 ("explicit", explicit, SamplingParams(1.0, seed=0))):
            sizes[key] += run(dec.runner, dec.drafter, prompt, params, 30)[1].tree_sizes
    assert max(sizes["greedy"]) > 6 and max(sizes["sampled"]) <= 6 and max(sizes["explicit"]) > 6
    rec["auto"]["lookup"] = -1
    save_tuning(rec, tuning_path(head))
    with pytest.raises(SpecdecError, match="lookup must be an integer"):
        from_models(tiny, None, "auto", head=str(head))

    # a shipped (package) head: tune writes under the cache, which wins over the shipped tuning.json
    monkeypatch.setattr(specdec.tuning, "PACKAGE_DIR", tmp_path.resolve())
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert tuning_path(head) == tmp_path / "cache" / "tuning" / "head.json"
    assert load_tuning(head) == dict(zip(TUNED, best))
    assert load_acceptance(head) == rec["acceptance"]
    save_tuning({"depth": 3, "topk": 2, "tree_size": 6}, tuning_path(head))
    d = from_models(tiny, None, "eagle2", head=str(head)).drafter
    assert astuple(d.budget) == (3, 2, 6)
    tuning_path(head).write_text('{"depth": 3}')
    with pytest.raises(SpecdecError, match="not a valid tuning file"):
        from_models(tiny, None, "eagle2", head=str(head))


def test_sampled_acceptance_table_sizes_autos_sampled_requests(tiny, trained, tmp_path, monkeypatch):
    from specdec.drafters.adaptive import AdaptiveDrafter
    from specdec.tune.sampled import sampled_acceptance

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    head = tmp_path / "head"
    shutil.copytree(trained[1] / "head", head)
    dec = from_models(tiny, None, "eagle2", head=str(head))  # children=sample at T > 0 by default
    budgets = [Config(1, 1, 1), Config(2, 2, 3), Config(3, 2, 6)]
    rows = sampled_acceptance(dec, PROMPTS[:2], tokens=24, budgets=budgets)
    assert [(r["depth"], r["topk"], r["tree_size"]) for r in rows] == [astuple(b) for b in budgets]
    assert all(r["tau"] >= 1 for r in rows) and rows[-1]["tau"] > 1  # a 6-node tree is accepted sometimes
    again = sampled_acceptance(dec, PROMPTS[:2], 24, budgets=budgets)
    assert [r["tau"] for r in rows] == [r["tau"] for r in again]  # seeded: the same draws (timings differ)
    assert all(r["tokens_per_second"] > 0 and r["draft_ms"] > 0 for r in rows)
    assert astuple(dec.drafter.sampled_budget) == astuple(dec.drafter.budget) == (5, 4, 10)  # left as it was
    topk = from_models(tiny, None, "eagle2", head=str(head), children="topk")
    with pytest.raises(SpecdecError, match="children='sample'"):
        sampled_acceptance(topk, PROMPTS[:1], budgets=budgets)

    greedy_rows = [{**asdict(b), "tau": 1.5} for b in budgets]
    save_tuning({"depth": 2, "topk": 2, "tree_size": 3, "acceptance": greedy_rows}, tuning_path(head))
    assert load_acceptance(head, sampled=True) == []  # not measured: auto's sampled requests draft top-k
    a = from_models(tiny, None, "auto", head=str(head)).drafter
    assert a.sampled is None and a.model.children == "topk"
    with pytest.raises(SpecdecError, match="no sampled acceptance table"):
        from_models(tiny, None, "auto", head=str(head), children="sample")
    save_tuning({"depth": 2, "topk": 2, "tree_size": 3, "acceptance": greedy_rows, "acceptance_sampled": rows},
                tuning_path(head))
    assert load_acceptance(head, sampled=True) == [{k: r[k] for k in (*TUNED, "tau")} for r in rows]
    a = from_models(tiny, None, "auto", head=str(head))
    d = a.drafter
    assert isinstance(d, AdaptiveDrafter) and d.model.children == "sample"
    assert {astuple(b) for b, _ in d.sampled} <= {astuple(b) for b in budgets} and set(d.costs.sampled_s) == {
        b for b, _ in d.sampled}
    assert from_models(tiny, None, "auto", head=str(head), children="topk").drafter.sampled is None
    from specdec.drafters.costs import Costs

    # this tiny target's forward costs about what a draft does: price drafting as free to see the trees
    d.costs = Costs({1: 1.0, 64: 1.0}, dict.fromkeys(d.costs.draft_s, 0.0), 0.0, 0.0,
                                    dict.fromkeys(d.costs.sampled_s, 0.0))
    trees = []
    orig = d.model.drafting

    def spy(ctx, b=None):
        trees.append(t := (yield from orig(ctx, b)))
        return t

    d.model.drafting = spy
    for prompt in PROMPTS[:3]:
        torch.manual_seed(1)
        run(a.runner, d, prompt, SamplingParams(1.0), 24)  # unseeded: children drawn from the draft
    assert trees and all(t.draft_probs is not None for t in trees if len(t))  # sampled children
    trees.clear()
    want, _ = run(a.runner, NoDrafter(), PROMPTS[1], SamplingParams(), 24)
    assert run(a.runner, d, PROMPTS[1], SamplingParams(), 24)[0] == want
    assert trees and all(t.draft_probs is None for t in trees)  # greedy requests: top-k trees
    with pytest.raises(SpecdecError, match="children=sample"):  # a static tree cannot hold the chain too
        from_models(tiny, None, "auto", head=str(head), children="sample", lookup=4, adaptive=False)


def test_eagle2_drafts_tunes_sampled_choice_for_sampled_requests(tiny, trained, tmp_path):
    from specdec.tune.sampled import choose_sampled

    head = tmp_path / "head"
    shutil.copytree(trained[1] / "head", head)
    rows = [{"depth": 1, "topk": 2, "tree_size": 2, "tau": 1.4, "draft_ms": 1.0, "tokens_per_second": 30.0},
            {"depth": 3, "topk": 3, "tree_size": 8, "tau": 1.8, "draft_ms": 3.0, "tokens_per_second": 60.0},
            {"depth": 2, "topk": 2, "tree_size": 3, "tau": 1.5, "draft_ms": 1.5, "tokens_per_second": 55.0}]
    target_ms = {"3": 20.0, "4": 21.5, "9": 27.0}
    # priced by the cost model, not the wall time: 1.4 / 21 ms = 66.7 > 1.5 / 23 ms = 65.2 > 1.8 / 30 ms
    assert choose_sampled(rows, target_ms) == {**{k: rows[0][k] for k in ("depth", "topk", "tree_size", "tau")},
                                               "tokens_per_second": 66.67}
    assert choose_sampled(rows, {**target_ms, "9": 20.0})["tree_size"] == 8  # = 1.8 / 23 ms
    with pytest.raises(SpecdecError, match="no sampled tree was timed"):
        choose_sampled([{**r, "draft_ms": 0.0} for r in rows], target_ms)
    save_tuning({"depth": 3, "topk": 3, "tree_size": 8}, tuning_path(head))
    d = from_models(tiny, None, "eagle2", head=str(head)).drafter
    assert astuple(d.sampled_budget) == astuple(d.budget) == (3, 3, 8)  # no sampled choice: the tuned one
    save_tuning({"depth": 3, "topk": 3, "tree_size": 8, "sampled": choose_sampled(rows, target_ms)}, tuning_path(head))
    dec = from_models(tiny, None, "eagle2", head=str(head))
    d = dec.drafter
    assert (astuple(d.budget), astuple(d.sampled_budget), d.draft_depth) == ((3, 3, 8), (1, 2, 2), 3)
    sizes = {}
    for key, params in (("greedy", SamplingParams()), ("sampled", SamplingParams(1.0, seed=0))):
        sizes[key] = [n for p in PROMPTS[:3] for n in run(dec.runner, d, p, params, 24)[1].tree_sizes]
    assert max(sizes["greedy"]) > 2 and 0 < max(sizes["sampled"]) <= 2
    assert run(dec.runner, d, PROMPTS[1], SamplingParams(), 24)[0] == run(dec.runner, NoDrafter(), PROMPTS[1],
                                                                          SamplingParams(), 24)[0]
    d = from_models(tiny, None, "eagle2", head=str(head), depth=2, topk=4).drafter  # explicit options win
    assert (astuple(d.budget), astuple(d.sampled_budget)) == ((2, 4, 8), (2, 4, 2))
    d = from_models(tiny, None, "eagle2", head=str(head), children="topk").drafter  # top-k: one tree for all
    assert astuple(d.sampled_budget) == (3, 3, 8)


def test_bad_input_is_a_clear_error(tiny, tmp_path, monkeypatch, capsys):
    assert main(["tune", "--head", str(tmp_path / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["tune", "--prompts", "0"]) == 2
    assert "--prompts must be" in capsys.readouterr().err
    assert main(["tune", "--sampled-tokens", "-1"]) == 2
    assert "--sampled-tokens must be" in capsys.readouterr().err
    for bad in ("4,x", "0,8"):
        assert main(["tune", "--lookups", bad]) == 2
        assert "--lookups must be" in capsys.readouterr().err
    monkeypatch.setattr("specdec.tune.cli.load_model", lambda *a, **k: (tiny, None, None))
    assert main(["tune"]) == 2  # a model without a shipped head and no --head
    assert "no EAGLE head ships for this model: pass --head" in capsys.readouterr().err
    with pytest.raises(SpecdecError, match="needs an eagle2 decoder"):
        tune(from_models(tiny, None), PROMPTS[:1])
    (tmp_path / "t.json").write_text(json.dumps({"depth": 0, "topk": 2, "tree_size": 4}))
    monkeypatch.setattr("specdec.tuning.tuning_path", lambda h: tmp_path / "t.json")
    with pytest.raises(SpecdecError, match="integers >= 1"):
        load_tuning(tmp_path)


def test_lookup_node_outcomes_follow_the_verifier():
    """Each step's lookup chain (its root the last emitted token) is tested node by node while the earlier
    nodes matched, as a verifier accepts: after "1 2 3 4 5 6 1" and the first answer token 2, the chain
    copies "3 4 5" (a 2-gram match); the answer takes 3 (hit), then 9 (a miss: node 3 is never tested); after
    "1 2 3" the 3-gram match proposes 4, missed again; after 9 nothing matches."""
    out = node_outcomes([1, 2, 3, 4, 5, 6, 1], [2, 3, 9, 5], PromptLookupDrafter(chain_len=3))
    assert out == [(pytest.approx(0.5), True), (pytest.approx(0.6), False), (pytest.approx(0.6), False)]


def test_n_gram_tree_node_outcomes_test_every_child_of_a_matched_node():
    """`auto`'s n-gram tree: after "1 2 7 1 5 8 1 5 3" and the answer's 1, "1" was followed by 5 twice and
    by 2 once: both children are tested, 5 (the likelier) hits, 2 misses; 5's children 3 and 8 both miss
    the answer's 9, and after "1 5" so do they again. Each confidence is the node's own given its parent."""
    out = node_outcomes([1, 2, 7, 1, 5, 8, 1, 5, 3], [1, 5, 9], NgramDrafter(16, 2))
    assert [hit for _, hit in out] == [True] + [False] * 5
    assert out[0][0] > out[1][0] and all(0 < c < 1 for c, _ in out)


def test_lookup_rates_are_measured_shipped_and_read_back(tiny, trained, tmp_path, monkeypatch):
    """Rates apply to the n-gram drafter they were measured with: an untuned head drafts beside the n-gram
    tree, so rates measured with it are its priors, and rates of a lookup chain are not."""
    dec = from_models(tiny, None, "eagle2", head=str(trained[1] / "head"))
    rates = lookup_rates(dec, PROMPTS[:2], 40, lambda: beside_head(None))
    assert len(rates) == len(EDGES) + 1 and all(r is None or 0 <= r <= 1 for r in rates)
    assert rates != lookup_rates(dec, PROMPTS[:2], 40, lambda: beside_head(4))  # other nodes, other shares
    head = tmp_path / "head"
    shutil.copytree(trained[1] / "head", head)
    key = ngram_key(beside_head(None))
    rec = {"depth": 2, "topk": 2, "tree_size": 3,
           "lookup_rates": {"drafter": key, "greedy": rates, "sampled": [0.5] * len(rates)}}
    save_tuning(rec, head / "tuning.json")
    want = {"greedy": rates, "sampled": [0.5] * len(rates)}
    assert load_lookup_rates(head, len(rates), key) == want
    assert load_lookup_rates(head, len(rates), "pld:4") is None  # measured with another drafter: not used
    assert load_lookup_rates(head, len(rates) + 1, key) is None  # measured over other buckets: not used
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert from_models(tiny, None, "auto", head=str(head)).drafter.lookup_rates == want
    assert from_models(tiny, None, "auto", head=str(head), lookup=4).drafter.lookup_rates is None
    del rec["lookup_rates"]["drafter"]  # a file naming none measured the 12-token chain
    save_tuning(rec, head / "tuning.json")
    assert load_lookup_rates(head, len(rates), "pld:12") == want and load_lookup_rates(head, len(rates), key) is None
    rec["lookup_rates"]["sampled"] = [2.0] * len(rates)
    save_tuning(rec, head / "tuning.json")
    with pytest.raises(SpecdecError, match="lookup_rates"):
        load_lookup_rates(head, len(rates), "pld:12")
