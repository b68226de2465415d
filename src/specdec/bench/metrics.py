"""Pure arithmetic over benchmark records (plain dicts, as written to raw/*.jsonl); no torch here.

A record is one timed generation: {"method", "name", "question_id", "category", "turn", "repeat",
"wall_time", "new_tokens", "tokens", "stats": None | {"target_forwards", "accept_histogram",
"depth_tries", "depth_accepts", "time": {...}, "gamma"}, "calibration": [[conf, value, depth, ok]]}.
τ follows docs/design.md, "Terms": tokens per target forward in the decode phase, prefill excluded.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

OVERALL = "overall"


def tau_from_histogram(hist: dict) -> float:
    """hist: accepted length (accepted + 1 bonus) -> number of forwards."""
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else 0.0


def merge_histograms(hists) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for h in hists:
        for k, v in h.items():
            out[int(k)] += v
    return dict(sorted(out.items()))


def sum_lists(lists) -> list[float]:
    """Elementwise sum of lists of different lengths (depth k absent = 0)."""
    out: list[float] = []
    for xs in lists:
        for i, x in enumerate(xs):
            if i == len(out):
                out.append(0)
            out[i] += x
    return out


def alpha_by_depth(tries: list[int], accepts: list[int]) -> list[float]:
    """α_k = accepted at depth k / tried at depth k (tried = depth k-1 was accepted)."""
    return [a / t if t else 0.0 for a, t in zip(accepts, tries)]


def mean_alpha(tries: list[int], accepts: list[int]) -> float:
    """Acceptance rate of every tried draft token: Leviathan's α for a chain."""
    t = sum(tries)
    return sum(accepts) / t if t else 0.0


def speedup(baseline_times, method_times, baseline_tokens=None, method_tokens=None) -> float:
    """Baseline time per token / method time per token, totals over the same prompts. With T > 0 the
    methods emit different texts of different lengths, so only per-token time compares them; without
    token counts (or at T = 0, where every output is the same) it is the wall-time ratio."""
    m = sum(method_times)
    if not m:
        return float("nan")
    if baseline_tokens is None or method_tokens is None:
        return sum(baseline_times) / m
    nb, nm = sum(baseline_tokens), sum(method_tokens)
    return (sum(baseline_times) / nb) / (m / nm) if nb and nm else float("nan")


def expected_tau(alpha: float, gamma: float) -> float:
    """Expected tokens per target forward for a chain of γ with i.i.d. acceptance α (Leviathan eq. 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_improvement(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. (2023) Thm 3.8: walltime improvement (1−α^{γ+1}) / ((1−α)(γc+1)),
    c = cost of one draft step / cost of one target forward."""
    return expected_tau(alpha, gamma) / (gamma * c + 1.0)


def cost_ratio(draft_time: float, draft_steps: float, target_forward_time: float) -> float:
    if not draft_steps or not target_forward_time:
        return float("nan")
    return (draft_time / draft_steps) / target_forward_time


def mean_std(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def calibration_pairs(trace) -> list[list]:
    """(confidence, value V, depth, accepted) for every node whose parent was reached, i.e. every node the
    verifier actually tried, from a generation's (scores, parents, accepted path) per verified tree;
    confidence = the node's own draft probability."""
    out = []
    for scores, parents, path in trace:
        s, par = scores.float().cpu().tolist(), parents.tolist()
        on_path = set(path)
        depth = []
        for i, p in enumerate(par):
            depth.append(1 if p < 0 else depth[p] + 1)
            if p >= 0 and p not in on_path:
                continue
            conf = s[i] - (s[p] if p >= 0 else 0.0)
            out.append([round(math.e ** conf, 5), round(math.e ** s[i], 5), depth[i], i in on_path])
    return out


def calibration_curve(pairs, bins: int = 10) -> list[dict]:
    """pairs: (confidence in [0, 1], accepted bool). Equal-width bins; empty bins are left out."""
    acc = [[0, 0, 0.0] for _ in range(bins)]  # count, accepted, sum of confidence
    for conf, ok in pairs:
        b = min(bins - 1, max(0, int(conf * bins)))
        acc[b][0] += 1
        acc[b][1] += int(bool(ok))
        acc[b][2] += conf
    return [
        {"lo": i / bins, "hi": (i + 1) / bins, "n": n, "confidence": s / n, "acceptance": a / n}
        for i, (n, a, s) in enumerate(acc) if n
    ]


def time_split(times: list[dict]) -> dict[str, float]:
    keys = ("prefill", "draft", "verify", "overhead")
    tot = {k: sum(t.get(k, 0.0) for t in times) for k in keys}
    total = sum(t.get("total", 0.0) for t in times)
    return {**tot, "total": total, **{f"{k}_frac": (tot[k] / total if total else 0.0) for k in keys}}


def _key(r: dict) -> tuple:
    return (r["question_id"], r["turn"])


def choose_baseline(records: list[dict], candidates=("hf", "vanilla")) -> str:
    """The faster (least wall time per token over the common prompts) of HF generate and our vanilla."""
    totals = {}
    by_method = defaultdict(dict)
    for r in records:
        by_method[r["method"]][(_key(r), r["repeat"])] = (r["wall_time"], r["new_tokens"])
    present = [c for c in candidates if c in by_method]
    if not present:
        raise ValueError("no baseline candidate among the records")
    common = set.intersection(*(set(by_method[c]) for c in present))
    for c in present:
        t, n = (sum(x) for x in zip(*(by_method[c][k] for k in common))) if common else (0.0, 0)
        totals[c] = t / n if n else float("inf")
    return min(present, key=lambda c: (totals[c], candidates.index(c)))


def fastest_repeats(records: list[dict]) -> list[dict]:
    """Per method and prompt, its fastest repeat, as repeat 0. Why: another process only ever slows a
    generation (a 2-thread run by 2-50x), so the least wall time of a few repeats is the least disturbed
    estimate of what a method costs (timeit's rule). A host whose speed drifts over seconds still moves
    one prompt's ratio (the fastest of 4 repeats: 0.82x on a prompt `auto` runs at ~1.0x); stepping the
    methods in turn (runner's interleave="step") is what removes that."""
    best: dict[tuple, dict] = {}
    for r in records:
        k = (r["method"], *_key(r))
        if k not in best or r["wall_time"] < best[k]["wall_time"]:
            best[k] = r
    return [{**r, "repeat": 0} for r in best.values()]


def summarize(records: list[dict], baseline: str, vanilla: str | None = "vanilla") -> dict:
    """{method: {category | "overall": metrics}}. Speedup and tokens/s are computed per repeat over
    the prompts every method completed, then reported as mean and std over repeats."""
    by = defaultdict(list)
    for r in records:
        by[r["method"]].append(r)
    base_t = {(_key(r), r["repeat"]): (r["wall_time"], r["new_tokens"]) for r in by[baseline]}
    van_fwd = None
    if vanilla in by:  # our vanilla's cost of one decode forward: the c denominator
        vs = [r["stats"] for r in by[vanilla] if r.get("stats")]
        fwd = sum(s["target_forwards"] for s in vs)
        van_fwd = sum(s["time"]["verify"] for s in vs) / fwd if fwd else None
    van_t = {(_key(r), r["repeat"]): (r["wall_time"], r["new_tokens"]) for r in by.get(vanilla, [])}
    out: dict = {}
    for method, recs in by.items():
        cats = defaultdict(list)
        for r in recs:
            cats[r["category"]].append(r)
            cats[OVERALL].append(r)
        out[method] = {c: _cell(rs, base_t, van_t, van_fwd) for c, rs in cats.items()}
    return out


def _per_repeat(rs, ref_t) -> list[float]:
    reps = defaultdict(lambda: ([], [], [], []))
    for r in rs:
        k = (_key(r), r["repeat"])
        if k in ref_t:
            b = reps[r["repeat"]]
            b[0].append(ref_t[k][0])
            b[1].append(r["wall_time"])
            b[2].append(ref_t[k][1])
            b[3].append(r["new_tokens"])
    return [speedup(*reps[k]) for k in sorted(reps)]


def _cell(rs: list[dict], base_t: dict, van_t: dict, van_fwd: float | None) -> dict:
    sp_mean, sp_std = mean_std(_per_repeat(rs, base_t))
    vs_mean, _ = mean_std(_per_repeat(rs, van_t)) if van_t else (float("nan"), 0.0)
    tps = defaultdict(lambda: [0, 0.0])
    for r in rs:
        tps[r["repeat"]][0] += r["new_tokens"]
        tps[r["repeat"]][1] += r["wall_time"]
    tps_mean, tps_std = mean_std([n / t if t else float("nan") for n, t in tps.values()])
    cell = {
        "n": len(rs), "speedup": sp_mean, "speedup_std": sp_std, "speedup_vs_vanilla": vs_mean,
        "tokens_per_s": tps_mean, "tokens_per_s_std": tps_std,
        "new_tokens": sum(r["new_tokens"] for r in rs), "wall_time": sum(r["wall_time"] for r in rs),
    }
    checked = [r["json"] for r in rs if r.get("json")]
    if checked:  # the extraction set: answers that parse as JSON, and that fit their schema (None: unchecked)
        valid = [c["valid"] for c in checked if c["valid"] is not None]
        cell.update(constrained=all(r["constrained"] for r in rs if r.get("json")),
                    json_parses=sum(c["parses"] for c in checked) / len(checked),
                    json_valid=sum(valid) / len(valid) if len(valid) == len(checked) else None)
    stats = [r["stats"] for r in rs if r.get("stats")]
    if not stats:
        peer = [(r["new_tokens"], r["peer_stats"]["draft_n_accepted"]) for r in rs
                if (r.get("peer_stats") or {}).get("draft_n_accepted") is not None]
        if peer:  # a speculating llama-server: every decode forward gives one token plus the drafts it accepts
            decoded = sum(max(n - 1, 0) for n, _ in peer)
            cell["peer_tau"] = decoded / max(1, decoded - sum(a for _, a in peer))
        return cell
    hist = merge_histograms(s["accept_histogram"] for s in stats)
    tries = sum_lists(s["depth_tries"] for s in stats)
    accepts = sum_lists(s["depth_accepts"] for s in stats)
    fwd = sum(s["target_forwards"] for s in stats)
    split = time_split([s["time"] for s in stats])
    alpha = mean_alpha(tries, accepts)
    gamma = max((s.get("gamma") or len(s["depth_tries"]) for s in stats), default=0)
    cell.update(
        tau=tau_from_histogram(hist), accept_histogram=hist, alpha_by_depth=alpha_by_depth(tries, accepts),
        depth_tries=tries, alpha=alpha, target_forwards=fwd, time_split=split, gamma=gamma,
    )
    mask = sum(s["time"].get("mask", 0.0) for s in stats)
    if mask and fwd:  # a grammar's masks: per target forward, and as a share of the decode time (a step's)
        cell.update(mask_ms_per_step=1000 * mask / fwd, mask_frac=mask / max(split["total"] - split["prefill"], 1e-9))
    if gamma and fwd and van_fwd:
        c = cost_ratio(split["draft"], fwd * gamma, van_fwd)
        cell.update(cost_ratio=c, expected_tau=expected_tau(alpha, gamma),
                    expected_improvement=expected_improvement(alpha, gamma, c))
    sizes = [n for st in stats for n in st.get("tree_sizes") or []]
    if sizes:  # what the drafter chose to verify (an adaptive one varies it, 0 = a vanilla step)
        cell.update(vanilla_share=sum(n == 0 for n in sizes) / len(sizes),
                    tree_size_histogram=dict(sorted(Counter(sizes).items())))
    ll = [(st["loglik_per_token"], r["new_tokens"]) for r, st in ((r, r.get("stats")) for r in rs)
          if st and st.get("loglik_per_token") is not None]
    if ll:  # T > 0: the target's mean log-likelihood per answer token (a lossy rule drifts from vanilla's)
        cell["loglik_per_token"] = sum(v * n for v, n in ll) / max(1, sum(n for _, n in ll))
    cal = [(p[0], p[3]) for r in rs for p in r.get("calibration") or []]
    if cal:
        cell["calibration"] = calibration_curve(cal)
    return cell


def peak_rss(run: dict) -> dict[str, float]:
    """label -> peak RSS in MB where read: ours, the bench process's while the method ran (every model it loaded
    counts); a server peer's, its own process's since it started."""
    out = {}
    for m in run["methods"]:
        rss = m.get("peak_rss_mb", (m.get("weights") or {}).get("peak_rss_mb"))
        if rss is not None:
            out[m["label"]] = rss
    return out
