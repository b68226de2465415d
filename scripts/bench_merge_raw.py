"""Rebuild the summary of one or more `specdec bench` result dirs from their raw/*.jsonl (the prompts every
method completed), e.g. a run split in two parts. Prints Markdown: tok/s and ratios against the llama.cpp
peers (F32 and Q4_1) and our vanilla, τ, agreement with our fp32 vanilla, and tok/s per category.

    python scripts/bench_merge_raw.py /tmp/i23/all80 /tmp/i23/rest80
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from specdec.bench import metrics
from specdec.bench.audit import agreement

OVERALL = metrics.OVERALL


def load(dirs: list[str]) -> list[dict]:
    recs = []
    for d in dirs:
        for f in sorted(Path(d, "raw").glob("*.jsonl")):
            with open(f) as fh:
                recs += [json.loads(line) for line in fh]
    counts = collections.Counter((r["question_id"], r["turn"]) for r in recs)
    n_methods = len({r["method"] for r in recs})
    return [r for r in recs if counts[(r["question_id"], r["turn"])] == n_methods]


def main() -> None:
    recs = load(sys.argv[1:])
    s = metrics.summarize(recs, "vanilla", "vanilla")
    print(f"{len({(r['question_id'], r['turn']) for r in recs})} prompts, {len(s)} methods\n")
    ref = {k: s[k][OVERALL]["tokens_per_s"] for k in ("llamacpp:gguf=f32", "llamacpp:gguf=q4_1") if k in s}
    agr = agreement(recs, "vanilla", [m for m in s if m != "vanilla"])
    cols = ["method", "tok/s", "ms/token", *(f"vs `{k}`" for k in ref), "vs our vanilla", "τ", "mean draft",
            "identical to our fp32 vanilla"]
    print("| " + " | ".join(cols) + " |")
    print("|---" * (7 + len(ref)) + "|")
    for m, cells in s.items():
        c, a = cells[OVERALL], agr.get(m)
        t, tau, hist = c["tokens_per_s"], c.get("tau"), c.get("tree_size_histogram")
        size = "–" if not hist else f"{sum(int(k) * v for k, v in hist.items()) / sum(hist.values()):.2f}"
        print(f"| `{m}` | {t:.1f} | {1000 / t:.1f} | " + " | ".join(f"{t / v:.2f}×" for v in ref.values())
              + f" | {c['speedup_vs_vanilla']:.2f}× | {'–' if tau is None else f'{tau:.2f}'} | {size} | "
              + ("(reference)" if a is None else f"{a['identical']}/{a['compared']}") + " |")
    cats = [k for k in s["vanilla"] if k != OVERALL]
    print("\n| category | " + " | ".join(f"`{m}`" for m in s) + " |")
    print("|---" * (1 + len(s)) + "|")
    for cat in cats:
        print(f"| {cat} | " + " | ".join(f"{s[m][cat]['tokens_per_s']:.1f}" for m in s) + " |")


if __name__ == "__main__":
    main()
