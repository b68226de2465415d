"""Vanilla vs static `auto` vs adaptive `auto` in one warm process, interleaved per prompt (a measurement,
not a test). Spec-Bench's six tasks, first turns, the same chat template as `bench`, plus the README demo
prompt as its own row.

    python scripts/adaptive_compare.py --per-category 5 --max-new-tokens 256 --temperatures 0,1 --threads 2

Prints per category and overall the tokens/s ratio to vanilla (total tokens / total time over the same
prompts, prefill included), tau, the share of adaptive steps without a draft and the sizes it verified, whether greedy
outputs equal vanilla's, and the costs the adaptive drafter measured (or found cached) on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict

import torch

from specdec.api import from_models
from specdec.bench.data import MT_BENCH_CATEGORIES, Question, load_questions
from specdec.cli import DEFAULT_PROMPT
from specdec.target.loading import load_model

# static: the shipped tuned tree (top-k children); adaptive-topk: adaptive sizing without sampled children at
# T > 0 (isolates what the sampled children add); adaptive: `auto` as it ships
METHODS = {"vanilla": {}, "static": {"adaptive": False}, "adaptive-topk": {"children": "topk"}, "adaptive": {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recalibrate", action="store_true", help="re-measure the adaptive drafter's costs first")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)} (vanilla and "
                    "adaptive always run)")
    ap.add_argument("--out", default=None, help="write every generation's numbers here (jsonl)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = {m: METHODS[m] for m in dict.fromkeys(["vanilla", "adaptive", *args.methods.split(",")])}
    model, tok, _ = load_model(None, "cpu")
    qs, seen = [("demo", Question("demo", "demo", [DEFAULT_PROMPT]))], Counter()
    for q in load_questions("spec_bench"):  # Spec-Bench's six tasks: MT-bench's 8 categories count as one
        task = "mt_bench" if q.category in MT_BENCH_CATEGORIES else q.category
        if seen[task] < args.per_category:
            seen[task] += 1
            qs.append((task, q))
    t = time.perf_counter()
    decs = {m: from_models(model, tok, "auto" if m != "vanilla" else "vanilla",
                           **kw, **({"recalibrate": True} if args.recalibrate and m.startswith("adaptive") else {}))
            for m, kw in methods.items()}
    print(f"decoders built in {time.perf_counter() - t:.1f} s; threads {torch.get_num_threads()}")
    ad = decs["adaptive"].drafter
    print("adaptive menu (budget, greedy expected accepted):", [(tuple(b.__dict__.values()), round(g, 3))
                                                              for b, g in ad.menu])
    if ad.sampled:
        print("adaptive sampled menu (budget, T=1 expected accepted):",
              [(tuple(b.__dict__.values()), round(g, 3)) for b, g in ad.sampled])
    print("costs:", json.dumps(ad.costs.to_json()))
    for d in decs.values():
        d.generate("Hello", max_new_tokens=8)  # warm-up
    records = []
    for temp in [float(x) for x in args.temperatures.split(",")]:
        tot = defaultdict(lambda: [0, 0.0])  # (method, category) -> tokens, seconds
        tau = defaultdict(list)
        sizes = Counter()
        same = []
        for i, (task, q) in enumerate(qs):
            run = [m for m in methods if temp > 0 or m != "adaptive-topk"]  # children matter at T > 0 only
            k = i % len(run)
            order = run[k:] + run[:k]  # rotate who goes first
            res = {}
            for m in order:
                g = decs[m].generate([{"role": "user", "content": q.turns[0]}], max_new_tokens=args.max_new_tokens,
                                     temperature=temp, seed=i)
                res[m] = g
                busy = g.stats.total_time - g.stats.wait_time  # prefill included (the head reads the prompt too)
                for key in ((m, task), (m, "overall")):
                    tot[key][0] += g.stats.new_tokens
                    tot[key][1] += busy
                tau[m].append(g.stats.tau)
                records.append(json.dumps({"T": temp, "q": q.question_id, "cat": task, "method": m,
                                          "tokens": g.stats.new_tokens, "busy_s": busy, "tau": g.stats.tau,
                                          "sizes": g.stats.tree_sizes}))
            sizes.update(res["adaptive"].stats.tree_sizes)
            # greedy, and seeded sampling (the coupling): every method's text is vanilla's
            same.append(all(r.token_ids == res["vanilla"].token_ids for r in res.values()))
        cats = sorted({c for _, c in tot if c != "overall"}) + ["overall"]
        print(f"\nT = {temp}: tok/s ratio to vanilla (all new tokens / total time), {len(qs)} prompts, "
              f"{args.max_new_tokens} new tokens")
        others = [m for m in methods if m != "vanilla" and (m, "overall") in tot]
        print(f"{'category':16s} {'vanilla tok/s':>14s} " + " ".join(f"{m:>14s}" for m in others))
        worst = {m: 9.9 for m in others}
        for c in cats:
            rate = {m: tot[(m, c)][0] / tot[(m, c)][1] for m in ["vanilla", *others]}
            v = rate["vanilla"]
            print(f"{c:16s} {v:14.1f} " + " ".join(f"{rate[m] / v:13.2f}x" for m in others))
            worst = {m: min(worst[m], rate[m] / v) for m in others}
        print("lowest per category: " + ", ".join(f"{m} {w:.2f}x" for m, w in worst.items()))
        n = sum(sizes.values())
        print("tau: " + ", ".join(f"{m} {sum(tau[m]) / len(qs):.2f}" for m in others) + "; "
              f"adaptive steps without a draft {100 * sizes[0] / n:.1f}%; sizes {dict(sorted(sizes.items()))}")
        if same:
            print(f"outputs identical across all methods: {sum(same)}/{len(same)}")
    for m in methods:  # a load change since the costs were measured: rescaled from the forwards run
        d = decs[m].drafter
        if d.costs_source:
            print(f"{m}: costs {d.costs_source}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(records) + "\n")


if __name__ == "__main__":
    main()
