"""A/B of two checkouts of specdec (not a test): greedy outputs must match token for token, and speed is
compared in one interleaved run. Each side runs in its own worker process (PYTHONPATH = that
checkout's src/); the parent asks them in turn, one at a time, so machine drift hits both alike.

    python scripts/ab_compare.py --old /tmp/before/src --new src --methods vanilla,pld,eagle,eagle2,auto \
        --limit 80 --max-new-tokens 64 --out ab.json
    python scripts/ab_compare.py --old /tmp/before/src --new src --methods vanilla,eagle2,auto \
        --limit 20 --max-new-tokens 128 --repeats 2 --out ab-speed.json

Only `specdec.runtime.loading.load_model` and `specdec.api.from_models(model, tok, method, draft_model,
draft_tok)` are used, so it runs against any checkout that has them. `sps`/`sps-tree` draft with the
target itself (a behaviour check, not a speed claim).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from specdec.api import from_models
from specdec.runtime.loading import load_model
model, tok, _ = load_model(None, "cpu", torch.float32)
decs = {}
def dec(m):
    if m not in decs:
        draft = (model, tok) if m in ("sps", "sps-tree") else (None, None)
        decs[m] = from_models(model, tok, m, *draft)
    return decs[m]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    d = dec(req["method"])
    t = time.perf_counter()
    g = d.generate([{"role": "user", "content": req["prompt"]}], max_new_tokens=req["max_new_tokens"])
    print(json.dumps({"ids": g.token_ids, "s": time.perf_counter() - t, "tau": g.stats.tau}), flush=True)
"""


class Worker:
    def __init__(self, src: str, threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, str(threads)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert json.loads(self.p.stdout.readline())["ready"]

    def ask(self, **req) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())


def prompts(limit: int, categories: str = "") -> list[str]:
    """MT-bench first turns, or with categories the first `limit` Spec-Bench questions of each."""
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not categories:
        lines = (data / "mt_bench" / "question.jsonl").read_text().splitlines()[:limit]
        return [json.loads(x)["turns"][0] for x in lines]
    qs = [json.loads(x) for x in (data / "spec_bench" / "question.jsonl").read_text().splitlines()]
    return [q["turns"][0] for c in categories.split(",") for q in [q for q in qs if q["category"] == c][:limit]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="src/ of the reference checkout")
    ap.add_argument("--new", required=True, help="src/ of the changed checkout")
    ap.add_argument("--methods", default="vanilla,pld,eagle,eagle2,auto")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--categories", default="", help="Spec-Bench categories (e.g. summarization,rag): --limit "
                    "questions of each instead of MT-bench")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sides = {"old": Worker(a.old, a.threads), "new": Worker(a.new, a.threads)}
    methods = a.methods.split(",")
    qs = prompts(a.limit, a.categories)
    res = {m: {"old": [], "new": [], "old_s": [], "new_s": [], "mismatch": []} for m in methods}
    for qi, q in enumerate(qs):
        for rep in range(a.repeats):
            for mi, m in enumerate(methods):
                order = ("old", "new") if (qi + rep + mi) % 2 == 0 else ("new", "old")  # alternate who goes first
                out = {s: sides[s].ask(method=m, prompt=q, max_new_tokens=a.max_new_tokens) for s in order}
                r = res[m]
                for s in ("old", "new"):
                    r[f"{s}_s"].append(out[s]["s"])
                if rep == 0:
                    r["old"].append(out["old"]["ids"])
                    r["new"].append(out["new"]["ids"])
                    if out["old"]["ids"] != out["new"]["ids"]:
                        r["mismatch"].append(qi)
        print(f"{qi + 1}/{len(qs)}", file=sys.stderr, flush=True)
    summary = {}
    for m, r in res.items():
        ratio = statistics.median(o / n for o, n in zip(r["old_s"], r["new_s"]))
        summary[m] = {"prompts": len(qs), "identical": len(qs) - len(r["mismatch"]), "mismatch": r["mismatch"],
                      "old_total_s": round(sum(r["old_s"]), 2), "new_total_s": round(sum(r["new_s"]), 2),
                      "median_old_over_new": round(ratio, 3)}
        print(f"{m:10s} identical {summary[m]['identical']}/{len(qs)}  old {summary[m]['old_total_s']:8.1f} s  "
              f"new {summary[m]['new_total_s']:8.1f} s  median old/new {ratio:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "summary": summary}, indent=1))
    return 0 if all(not r["mismatch"] for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
