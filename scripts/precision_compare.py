"""Weight precisions side by side in one warm process (a measurement, not a test): for fp32, bf16, fp16
and int8 targets, vanilla and auto (EAGLE-2 + lookup) on the README demo prompt and Spec-Bench prompts
(MT-bench and GSM8K rows), interleaved per prompt. Prints tok/s, tau, whether auto equals vanilla at
the same precision (it must, bit for bit) and how many tokens agree with fp32 vanilla before the first
difference.

    python scripts/precision_compare.py [--prompts 6] [--tokens 128] [--weights fp32,bf16,int8]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdec.api import from_models
from specdec.files import find_data
from specdec.target.loading import load_model

DEMO = "Explain in a few sentences why the sky is blue."


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="fp32,bf16,fp16,int8")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok, _ = load_model(None, "cpu")
    with open(find_data("spec_bench/question.jsonl")) as f:
        questions = [json.loads(line) for line in f]
    pool = [q["turns"][0] for q in questions[:80:16]] + [q["turns"][0] for q in questions[400::16]]
    prompts = ([DEMO] + pool)[: args.prompts]
    precisions = args.weights.split(",")
    decs = {(w, m): from_models(model, tok, m, weights=w) for w in precisions for m in ("vanilla", "auto")}
    for d in decs.values():
        d.generate("Hello", max_new_tokens=8)  # warm-up
    keys = list(decs)
    res: dict = {k: [] for k in keys}
    for i, p in enumerate(prompts):
        k0 = i % len(keys)
        for k in keys[k0:] + keys[:k0]:  # rotated order: drift spreads over every configuration
            res[k].append(decs[k].generate([{"role": "user", "content": p}], max_new_tokens=args.tokens))
    ref = res.get(("fp32", "vanilla"))
    base = statistics.mean(g.stats.tokens_per_second for g in res[(precisions[0], "vanilla")])
    print(f"{len(prompts)} prompts x {args.tokens} new tokens, greedy, 2 threads; speed vs {precisions[0]} vanilla")
    print("| weights | method | tok/s | vs first vanilla | tau | = own vanilla | tokens agreeing with fp32 vanilla |")
    print("|---|---|---|---|---|---|---|")
    for w in precisions:
        for m in ("vanilla", "auto"):
            gs = res[(w, m)]
            tps = statistics.mean(g.stats.tokens_per_second for g in gs)
            same = sum(g.token_ids == v.token_ids for g, v in zip(gs, res[(w, "vanilla")]))
            agreeing = "—" if ref is None else \
                f"{statistics.mean(agree(g.token_ids, r.token_ids) for g, r in zip(gs, ref)):.0f}"
            tau = statistics.mean(g.stats.tau for g in gs)
            print(f"| {w} | {m} | {tps:.1f} | {tps / base:.2f} | {tau:.2f} | {same}/{len(gs)} | {agreeing} |")


if __name__ == "__main__":
    main()
