"""`specdec bench merge DIR...`: one summary of one or more result dirs rebuilt from their raw/*.jsonl, over
the prompts every method completed (e.g. a run split in two parts, or one where a peer failed on some
prompts). Markdown: tok/s and ratios against each llama.cpp plain peer and our vanilla, τ, mean draft size,
agreement with our vanilla, and tok/s per category."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from specdec.bench import metrics
from specdec.bench.audit import agreement
from specdec.bench.outdir import report_dest, write_report
from specdec.errors import SpecdecError

OVERALL = metrics.OVERALL


def add_parser(bs) -> None:
    m = bs.add_parser("merge", help="one summary of several result dirs from their raw/*.jsonl",
                      description=__doc__)
    m.add_argument("dirs", nargs="+", help="`specdec bench` result dirs (each with raw/*.jsonl)")
    m.add_argument("--out", dest="merge_out", default=None, help="also write the Markdown to this file")
    m.set_defaults(func=cmd_merge)


def load_records(dirs: list[str]) -> list[dict]:
    """Every raw record of the dirs, kept only for the prompts every method completed."""
    recs = []
    for d in dirs:
        files = sorted(Path(d, "raw").glob("*.jsonl"))
        if not files:
            raise SpecdecError(f"{d} is not a `specdec bench` results directory (no raw/*.jsonl)")
        for f in files:
            try:
                recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{f}: not valid JSON lines ({e.msg})") from None
    methods = collections.defaultdict(set)  # prompt -> the methods that completed it
    for r in recs:
        methods[(r["question_id"], r["turn"])].add(r["method"])
    n_methods = len({r["method"] for r in recs})
    return [r for r in recs if len(methods[(r["question_id"], r["turn"])]) == n_methods]


def merge(dirs: list[str]) -> str:
    recs = load_records(dirs)
    if not any(r["method"] == "vanilla" for r in recs):
        raise SpecdecError(f"{' '.join(dirs)}: no prompt that every method completed, vanilla among them")
    s = metrics.summarize(recs, "vanilla", "vanilla")
    ref = {k: s[k][OVERALL]["tokens_per_s"] for k in s if k.split(":")[0] == "llamacpp"}
    agr = agreement(recs, "vanilla", [m for m in s if m != "vanilla"])
    cols = ["method", "tok/s", "ms/token", *(f"vs `{k}`" for k in ref), "vs our vanilla", "τ", "mean draft",
            "identical to our vanilla"]
    lines = [f"{len({(r['question_id'], r['turn']) for r in recs})} prompts, {len(s)} methods", "",
             "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for m, cells in s.items():
        c, a = cells[OVERALL], agr.get(m)
        t, tau, hist = c["tokens_per_s"], c.get("tau"), c.get("tree_size_histogram")
        size = "–" if not hist else f"{sum(int(k) * v for k, v in hist.items()) / sum(hist.values()):.2f}"
        lines.append(f"| `{m}` | {t:.1f} | {1000 / t:.1f} | " + "".join(f"{t / v:.2f}× | " for v in ref.values())
                     + f"{c['speedup_vs_vanilla']:.2f}× | {'–' if tau is None else f'{tau:.2f}'} | {size} | "
                     + ("(reference)" if a is None else f"{a['identical']}/{a['compared']}") + " |")
    cats = [k for k in s["vanilla"] if k != OVERALL]
    lines += ["", "| category | " + " | ".join(f"`{m}`" for m in s) + " |", "|---" * (1 + len(s)) + "|"]
    lines += [f"| {cat} | " + " | ".join(f"{s[m][cat]['tokens_per_s']:.1f}" for m in s) + " |" for cat in cats]
    return "\n".join(lines) + "\n"


def cmd_merge(args) -> int:
    for d in args.dirs:  # every check before the work
        if not Path(d).is_dir():
            raise SpecdecError(f"{d!r} is not a directory")
    dest = report_dest(args.merge_out)
    write_report(merge(args.dirs), dest)
    return 0
