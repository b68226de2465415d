"""report.md and plots/*.png from run.json + summary.json + audit.json (re-runnable on a results dir)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from specdec.bench.metrics import OVERALL, peak_rss

PLOTS = ("speedup_by_category.png", "tau_by_category.png", "acceptance_by_depth.png", "calibration.png")
CONTENTION_WARN = 0.05  # share of the CPUs other processes may use before the numbers are flagged
TAU_NOTE = ("τ = tokens emitted per target forward in the decode phase (accepted draft tokens + 1 bonus), "
            "prefill excluded")


def _f(x, nd=2, suffix="") -> str:
    return _pm(x, None, nd, suffix)


def _pm(m, s, nd=2, suffix="") -> str:
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "—"
    return f"{m:.{nd}f}{suffix}" + (f" ± {s:.{nd}f}" if s else "")


def _cats(summary: dict, run: dict) -> list[str]:
    return [c for c in run.get("categories", []) if any(c in v for v in summary.values())] + [OVERALL]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _metric_table(summary, run, methods, fn, marks: dict | None = None) -> str:
    rows = []
    for c in _cats(summary, run):
        name = f"**{c}**" if c == OVERALL else c
        rows.append([name] + [fn(summary[m].get(c)) if summary[m].get(c) else "—" for m in methods])
    return _table(["category"] + [f"`{m}`{(marks or {}).get(m, '')}" for m in methods], rows)


def _floor_table(summary, run, methods) -> str:
    """tok/s as a share of τ × forwards/s at the floor of the method's own weight precision."""
    floors, default = run.get("floors") or {}, run["floor"]
    prec = {m["label"]: m.get("precision") for m in run["methods"]}
    rows = []
    for c in _cats(summary, run):
        row = [f"**{c}**" if c == OVERALL else c]
        for m in methods:
            cell, fl = summary[m].get(c), floors.get(prec.get(m), default)
            limit = fl["forwards_per_s"] * max(cell.get("tau") or 1, 1) if cell else None
            row.append(_f(cell["tokens_per_s"] / limit) if cell else "—")
        rows.append(row)
    return _table(["category"] + [f"`{m}`" for m in methods], rows)


def loaded(run: dict) -> dict[str, float]:
    """label -> share of the CPUs other processes used while it or the baseline ran, for the methods whose
    speedup that load may have moved (above CONTENTION_WARN); a speedup compares both methods' times."""
    by = (run.get("contention") or {}).get("by_method") or {}
    base = by.get(run.get("baseline")) or 0.0
    out = {}
    for lab, frac in by.items():
        worst = max(frac or 0.0, base)
        if lab != run.get("baseline") and worst > CONTENTION_WARN:
            out[lab] = worst
    return out


def setting(run: dict) -> str:
    """What every figure depends on: temperature, answer length, how many questions."""
    cfg = run["config"]
    return f"T={cfg['temperature']:g}, max {cfg['max_new_tokens']} new tokens, {run['questions']} questions"


def _mean_size(hist: dict) -> float:
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else 0.0


def render(run: dict, summary: dict, audit: dict) -> str:
    methods = [m["label"] for m in run["methods"] if m["label"] in summary]
    ours = [m for m in methods if summary[m][OVERALL].get("tau") is not None]
    spec = [m for m in ours if summary[m][OVERALL].get("alpha_by_depth")]
    cfg, mach, tgt = run["config"], run["machine"], run["target"]
    base = run["baseline"]
    other = (run.get("contention") or {}).get("other_cpu_frac")
    tot = run.get("baseline_candidates_total_s", {})
    md = [f"# specdec bench: {cfg['extra'].get('model') or tgt.get('name_or_path') or tgt['model_type']}", ""]
    if run.get("command"):
        md += ["```", run["command"], "```", ""]
    status = "PASS" if audit["ok"] else f"FAIL ({audit['bugs']} mismatch(es) that are not numerical ties)"
    md += [
        f"Started {run['started']}, {run['duration_s']:.0f} s in all ({run['timed_s']:.0f} s timed). "
        f"{run['questions']} questions, {run['generations']} timed generations. Losslessness audit: **{status}**."
        + "".join(f" `{m['label']}` is LOSSY (typical acceptance): not audited." for m in run["methods"]
                  if m.get("lossy")),
        "",
        "## Setup", "",
        _table(["", ""], [
            ["CPU", f"{mach['cpu']} ({mach['usable_cpus']} usable of {mach['logical_cpus']} logical CPUs)"],
            ["torch threads", f"{mach['torch_threads']} (interop {mach['torch_interop_threads']}), pinned for the run"],
            ["versions", f"python {mach['python']}, torch {mach['torch']}, transformers {mach['transformers']}, "
                         f"specdec {mach['specdec']} {mach.get('git_commit', '')}"],
            ["target", f"{cfg['extra'].get('model') or tgt.get('name_or_path')} ({tgt['model_type']}, "
                       f"{tgt['parameters'] / 1e6:.1f}M params, {tgt['dtype']}, our methods' linear weights "
                       f"{cfg.get('weights') or tgt['dtype']}, {tgt['device']}, "
                       f"runner {tgt['runner']})"],
            ["draft", "—" if not run.get("draft") else
             f"{run['draft'].get('name_or_path')} ({run['draft']['parameters'] / 1e6:.1f}M params)"],
            ["questions", f"{run['questions']} from {cfg['extra'].get('dataset', '?')} "
                          f"({', '.join(run['categories'])})"],
            ["decoding", f"max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, "
                         f"seed {cfg['seed']}, {cfg['repeats']} repeat(s)"
                         + (" (the fastest per prompt and method counts)" if cfg.get("timing") == "best" else "")
                         + f", {cfg['warmup']} warm-up round(s)"],
            ["baseline", f"`{base}` ({_f(tot.get(base), 1)} s in this run)" + ("" if tot.get("hf") is None else
                         f"; HF generate `hf` {_f(tot.get('hf'), 1)} s, our `vanilla` {_f(tot.get('vanilla'), 1)} s")],
            ["timing", "wall time per generation; per prompt the methods run "
                       + ("a decoding step (or a prefill forward of ≤ 64 rows) each in turn (lockstep), "
                          "in a rotated order"
                          if cfg.get("interleave") == "step" else "back to back in a rotated order")],
            ["other load", "—" if other is None else f"other processes used {100 * other:.1f}% of the CPUs "
                                                       "during the timed run"],
        ]), "",
    ]
    if other is not None and other > CONTENTION_WARN:
        md += [f"> **Warning: other processes used {100 * other:.0f}% of the CPUs during the timed run.** "
               "These timings measure that contention as much as the methods; rerun on an idle machine.", ""]
    if run.get("skipped"):
        md += [f"Skipped {len(run['skipped'])} prompt(s), for every method: "
               + "; ".join(f"{s['question_id']}/turn {s['turn']} ({s['reason']})" for s in run["skipped"]), ""]
    md += [f"## Speedup vs `{base}`", "",
           "Baseline wall time per token / method wall time per token, totals over the same prompts "
           "(at T = 0 every output is the same, so this is the wall-time ratio); "
           + ("per prompt and method the fastest of its repeats." if cfg.get("timing") == "best"
              else "mean ± std over repeats."), "",
           _metric_table(summary, run, methods, lambda c: _pm(c["speedup"], c["speedup_std"], 2, "×"),
                         marks={m: " ⚠" for m in loaded(run)}), ""]
    if loaded(run):
        md += ["⚠ Another load used CPU while the method or the baseline ran (contention meter, per method): "
               + "; ".join(f"`{m}` {100 * f:.0f}% of the CPUs" for m, f in loaded(run).items())
               + ". These speedups measure that load too.", ""]
    md += ["## Tokens per second", "", _metric_table(summary, run, methods,
                                                      lambda c: _pm(c["tokens_per_s"], c["tokens_per_s_std"], 1)), ""]
    fl = run.get("floor")
    if fl:
        md += ["## Against the memory floor", "",
               f"A target forward streams {fl['weight_mb']:.0f} MB of weights; this machine streams "
               f"{fl['bandwidth_gb_s']:.1f} GB/s, so a forward takes at least {fl['ms_per_forward']:.1f} ms and "
               f"plain decoding can reach at most {fl['forwards_per_s']:.1f} tok/s. A method emitting τ tokens per "
               "forward can reach at most τ × that; the table gives each method's tok/s as a share of its own "
               "limit (1.00 = every forward at the floor; drafting and overhead make up the rest).", "",
               _floor_table(summary, run, ours) if ours else "", ""]
        precs = {m["label"]: m.get("precision") for m in run["methods"]}
        extra = {w: f for w, f in (run.get("floors") or {}).items() if f != fl}
        if extra:
            md += ["Methods on other weights (`weights=`) are measured against their own floor: "
                   + "; ".join(f"{w}: {f['weight_mb']:.0f} MB, {f['ms_per_forward']:.1f} ms per forward "
                               f"({', '.join(f'`{m}`' for m in ours if precs.get(m) == w)})"
                               for w, f in extra.items()) + ".", ""]
    if rss := peak_rss(run):  # ours: the bench process's while the method ran; a server's: its own
        md += ["## Peak RSS, MB", "", "Ours: the bench process's, every method's models and caches in it.", "",
               _table(["method", "MB"], [[f"`{m}`", f"{v:.0f}"] for m, v in rss.items()]), ""]
    sized = [m for m in ours if summary[m][OVERALL].get("tree_size_histogram")]
    if sized:
        md += ["## Draft sizes", "",
               "Nodes verified per target forward (draft tree + lookup chain; 0 = a step without a draft): the "
               "share of steps without a draft and the histogram, `size: steps` (an adaptive method varies them).",
               "", _table(["method", "no draft", "mean size", "histogram"], [
                   [f"`{m}`", f"{100 * summary[m][OVERALL]['vanilla_share']:.1f}%",
                    _f(_mean_size(summary[m][OVERALL]["tree_size_histogram"]), 1),
                    ", ".join(f"{k}: {v}" for k, v in summary[m][OVERALL]["tree_size_histogram"].items())]
                   for m in sized]), ""]
    if ours:
        md += ["## τ", "", TAU_NOTE + ".", "", _metric_table(summary, run, ours, lambda c: _f(c.get("tau"))), ""]
    js = {m: summary[m][OVERALL] for m in methods if "json_parses" in summary[m][OVERALL]}
    if js:
        pct = lambda x, nd=0: _f(None if x is None else 100 * x, nd, "%")  # noqa: E731
        md += ["## Structured output", "", "Each question carries a JSON schema: a constrained method applies it, a "
               "free one answers without it. JSON: answers that parse; fit: that fit the schema too (jsonschema; — "
               "unchecked); mask: the grammar's time per target forward, and its share of the decode time.", "",
               _table(["method", "schema", "JSON", "fit", "τ", "tok/s", "mask ms/step", "mask share"], [
                   [f"`{m}`", "applied" if c["constrained"] else "free", pct(c["json_parses"]), pct(c["json_valid"]),
                    _f(c.get("tau", c.get("peer_tau"))), _f(c["tokens_per_s"], 1), _f(c.get("mask_ms_per_step")),
                    pct(c.get("mask_frac"), 1)]
                   for m, c in js.items()]), ""]
    ll = [m for m in ours if summary[m][OVERALL].get("loglik_per_token") is not None]
    if ll:
        md += ["## Target log-likelihood of the sampled answers", "",
               "Mean log p_target(token | its prefix) per answer token (T = 1 scale), one teacher-forced forward "
               "per answer: lossless methods sample the target's distribution and differ from vanilla only by "
               "noise; a lossy rule (typical acceptance) shifts it.", "",
               _metric_table(summary, run, ll, lambda c: _f(c.get("loglik_per_token"), 3)), ""]
    if spec:
        depth = max(len(summary[m][OVERALL]["alpha_by_depth"]) for m in spec)
        md += ["## Acceptance by depth", "", "α_k = accepted at depth k / tried at depth k (tried: depth k−1 was "
               "accepted); all categories.", "",
               _table(["method"] + [f"α_{k + 1}" for k in range(depth)], [
                   [f"`{m}`"] + [_f(a) for a in summary[m][OVERALL]["alpha_by_depth"]]
                   + ["—"] * (depth - len(summary[m][OVERALL]["alpha_by_depth"])) for m in spec]), ""]
        # keys are ints in memory, strings after a JSON round trip (rebuild)
        longest = max(max(map(int, summary[m][OVERALL]["accept_histogram"]), default=1) for m in spec)
        rows = []
        for m in spec:
            h = {int(k): v for k, v in summary[m][OVERALL]["accept_histogram"].items()}
            n = sum(h.values()) or 1
            rows.append([f"`{m}`"] + [_f(100 * h.get(k, 0) / n, 1, "%") for k in range(1, longest + 1)])
        md += ["## Accepted-length histogram", "", "Share of target forwards that emitted k tokens (accepted + bonus).",
               "", _table(["method"] + [f"k={k}" for k in range(1, longest + 1)], rows), ""]
    if ours:
        rows = []
        for m in ours:
            s = summary[m][OVERALL]["time_split"]
            rows.append([f"`{m}`", _f(s["total"], 1)] + [f"{_f(s[k], 1)} ({_f(100 * s[k + '_frac'], 0, '%')})"
                                                          for k in ("prefill", "draft", "verify", "overhead")])
        md += ["## Time split", "", "Seconds (share of the generation), all categories; overhead = the rest of the "
               "loop (KV compaction bookkeeping, drafter accept, emission).", "",
               _table(["method", "total s", "prefill", "draft", "verify", "overhead"], rows), ""]
    lev = [m for m in spec if "expected_improvement" in summary[m][OVERALL]]
    if lev:
        rows = []
        for m in lev:
            c = summary[m][OVERALL]
            rows.append([f"`{m}`", _f(c["alpha"], 3), str(c["gamma"]), _f(c["cost_ratio"], 3), _f(c["expected_tau"]),
                         _f(c["tau"]), _f(c["expected_improvement"], 2, "×"), _f(c["speedup_vs_vanilla"], 2, "×")])
        md += ["## Leviathan analysis", "",
               "α = acceptance rate of all tried draft tokens; c = draft step cost / target forward cost (our "
               "vanilla's decode forward); expected improvement = (1−α^{γ+1}) / ((1−α)(γc+1)), the chain "
               "formula with i.i.d. acceptance (trees may beat it: siblings add chances). Measured = speedup vs "
               "our `vanilla`.", "",
               _table(["method", "α", "γ", "c", "expected τ", "measured τ", "expected improvement", "measured"], rows),
               ""]
    md += ["## Losslessness audit", "",
           f"Mode: {audit.get('mode', '')}; reference: our `{audit['reference']}`; {audit['checked']} outputs checked; "
           f"{len(audit['mismatches'])} mismatch(es): {audit['ties']} numerical tie(s) (the two tokens' target logits "
           f"within {audit['tol']:g}), {audit['bugs']} bug(s).", ""]
    if audit["mismatches"]:
        md += [_table(["method", "question", "turn", "rep", "position", "vanilla tok", "method tok", "top-2 gap",
                       "pair gap", "verdict"], [
            [f"`{x['method']}`", str(x["question_id"]), str(x["turn"]), str(x["repeat"]), str(x["position"]),
             str(x["reference_token"]), str(x["method_token"]), f"{x['top2_gap']:.2e}",
             f"{x['pair_gap']:.2e}" if "pair_gap" in x else "—", x["verdict"]]
            for x in audit["mismatches"][:50]]), ""]
    md += _agreement(run, audit)
    md += ["## Plots", ""] + [f"![{p[:-4]}](plots/{p})" for p in PLOTS] + [""]
    md += ["## Files", "", "`run.json` (setup, machine), `summary.json` (every metric per method × category), "
           "`audit.json`, `raw/<method>.jsonl` (one line per generation: tokens, wall time, engine stats, calibration "
           "pairs), `specbench/<method>.jsonl` (Spec-Bench's answer format: its `evaluation/speed.py --file-path "
           "specbench/<method>.jsonl --base-path specbench/vanilla.jsonl` recomputes the speedups), `plots/`.", ""]
    return "\n".join(md)


def _agreement(run: dict, audit: dict) -> list[str]:
    """Peers on another engine (llama.cpp) are not audited: how often they emit our vanilla's tokens."""
    agr = audit.get("agreement") or {}
    if not agr:
        return []
    rows, schemas = [], any(x.get("constrained") for x in run["methods"])
    for m in run["methods"]:
        a, w = agr.get(m["label"]), m.get("weights") or {}
        if a is None:
            continue
        if m.get("lossy"):
            w = {"type": "ours, LOSSY (typical acceptance)", "gguf": "—"}
        elif m.get("precision"):  # ours on other weights or another target: audited on its own vanilla
            on = f" on target {m['target']}" if m.get("target") else ""
            ref = (audit.get("references") or {}).get(m["label"])
            w = {"type": f"ours, {m['precision']}{on} "
                 + (f"(audited against `{ref}`)" if ref else "(free of the schema: no free vanilla to audit against)"
                    if schemas and not m.get("constrained") and m["name"] != "vanilla"
                    else "(the reference of that precision, target and schema)"),
                 "gguf": "—"}
        ident = f"{a['identical']}/{a['compared']}" + (f" ({100 * a['identical_frac']:.0f}%)" if a["compared"] else "")
        div = "—" if a["first_divergence_mean"] is None else \
            f"{a['first_divergence_mean']:.1f} (earliest {a['first_divergence_min']})"
        what = w.get("type", "?") + (" (same weights)" if w.get("choice") == "f32" else "")
        if w.get("draft"):  # llama-server with a draft model or head
            what += f", draft {w['draft'].get('type', '?')} `{w['draft'].get('gguf', '?')}`"
        if w.get("peak_rss_mb") is not None:
            what += f", peak RSS {w['peak_rss_mb']:.0f} MB"
        rows.append([f"`{m['label']}`", what, f"`{w.get('gguf', '?')}`", ident, div])
    return ["## Agreement with our vanilla", "",
            f"Against `{audit.get('reference', 'vanilla')}`. Not part of its audit: other engines (their kernels; "
            "Q4_1 is other weights), lossy methods (Medusa's typical acceptance accepts tokens the target would not "
            "emit), and our methods on another weight precision or target (each audited against the vanilla of its own "
            "precision and target; here: how often that target's text is the main one's). "
            f"Mode: {audit.get('mode', '')}. "
            "Identical = the whole output equals our vanilla's; first divergence = mean token index where the "
            "differing outputs first differ.", "",
            _table(["method", "weights", "gguf", "identical outputs", "first divergence"], rows), ""]


def write_report(out: Path, run: dict, summary: dict, audit: dict) -> Path:
    out = Path(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plot_all(out / "plots", run, summary)
    p = out / "report.md"
    p.write_text(render(run, summary, audit))
    return p


def rebuild(out: str | Path) -> Path:
    """Regenerate report.md and plots from the JSON files of a results dir."""
    out = Path(out)
    load = lambda n: json.loads((out / n).read_text())  # noqa: E731
    return write_report(out, load("run.json"), load("summary.json"), load("audit.json"))


# ----------------------------------------------------------------------------------------------- plots


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _grouped(ax, cats, methods, value, names: dict | None = None) -> None:
    import numpy as np

    x = np.arange(len(cats))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = [value(m, c) for c in cats]
        ax.bar(x + (i - (len(methods) - 1) / 2) * w, [0 if y is None or math.isnan(y) else y for y in ys], w,
               label=(names or {}).get(m, m))
    ax.set_xticks(x)
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: labels are long


def _finish(plt, fig, ax, title: str, path: Path) -> None:
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(d: Path, run: dict, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m["label"] for m in run["methods"] if m["label"] in summary]
    cats = _cats(summary, run)
    title = run["config"]["extra"].get("model") or run["target"].get("name_or_path") or run["target"]["model_type"]
    get = lambda m, c, k: (summary[m].get(c) or {}).get(k)  # noqa: E731
    at = f"\n{setting(run)}"  # every plot: the numbers depend on them

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cats) + 2) + 3, 4))
    load = loaded(run)
    _grouped(ax, cats, [m for m in methods if m != run["baseline"]], lambda m, c: get(m, c, "speedup"),
             names={m: f"{m} (other load {100 * f:.0f}%)" for m, f in load.items()})
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup vs {run['baseline']}")
    _finish(plt, fig, ax, f"Speedup by category: {title}{at}", d / "speedup_by_category.png")

    ours = [m for m in methods if get(m, OVERALL, "tau") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cats) + 2) + 3, 4))
    _grouped(ax, cats, ours, lambda m, c: get(m, c, "tau"))
    ax.set_ylabel("τ (tokens / target forward)")
    _finish(plt, fig, ax, f"τ by category (decode phase, prefill excluded){at}", d / "tau_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    spec = [m for m in ours if get(m, OVERALL, "alpha_by_depth")]
    for m in spec:
        a = get(m, OVERALL, "alpha_by_depth")
        ax.plot(range(1, len(a) + 1), a, marker="o", label=m)
    if spec:
        ax.set_xlabel("tree depth k")
        ax.set_ylabel("α_k (accepted | depth k−1 accepted)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no speculative method in this run")
    _finish(plt, fig, ax, f"Acceptance by depth{at}", d / "acceptance_by_depth.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    cal = [m for m in ours if get(m, OVERALL, "calibration")]
    for m in cal:
        pts = get(m, OVERALL, "calibration")
        line, = ax.plot([p["confidence"] for p in pts], [p["acceptance"] for p in pts], label=m)
        n = max(p["n"] for p in pts)  # marker area ~ nodes in the bin: sparse bins are noisy
        ax.scatter([p["confidence"] for p in pts], [p["acceptance"] for p in pts],
                   s=[10 + 90 * p["n"] / n for p in pts], color=line.get_color())
    if cal:
        ax.plot([0, 1], [0, 1], color="k", lw=0.8, ls="--", label="perfect calibration")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft confidence of the node (marker size ~ nodes)")
        ax.set_ylabel("acceptance rate")
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no drafter in this run exposes tree scores\n(calibration needs e.g. sps-tree or eagle2)")
    _finish(plt, fig, ax, f"Draft confidence vs acceptance{at}", d / "calibration.png")
