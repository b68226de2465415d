"""How far a second target (a Medusa-2 run's `<run>/target`) drifts from the original in what it samples:
for the answers of a `specdec bench` run at T > 0, the mean log-likelihood per token under both models and
the mean entropy of each model's next-token distribution along those answers (teacher-forced, T = 1).

    python scripts/sample_drift.py bench-results/medusa-80-T1 ~/.cache/specdec/runs/medusa2-l8/target \\
        --methods vanilla,"vanilla:target=$HOME/.cache/specdec/runs/medusa2-l8/target" --limit 40

It scores text already generated (no timing), so it can run beside other work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.api import from_models
from specdec.bench.data import load_questions
from specdec.bench.runner import safe_name
from specdec.runtime.loading import load_like, load_model


@torch.no_grad()
def score(model, prompt: list[int], answer: list[int]) -> tuple[float, float]:
    """(sum log p(answer), sum entropy) over the answer positions."""
    logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return float(lp.gather(-1, torch.tensor(answer)[:, None]).sum()), float(-(lp.exp() * lp).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a `specdec bench --temperature T>0 --first-turn` output dir")
    ap.add_argument("other", help="the second target (HF dir with the original's tokenizer)")
    ap.add_argument("--methods", required=True, help="comma-separated method labels of the run")
    ap.add_argument("--model", default="smollm2", help="the original target")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--limit", type=int, default=0, help="answers per method (0 = all)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    orig, tok, _ = load_model(a.model, "cpu", torch.float32)
    other = load_like(a.other, orig, tok)
    enc = from_models(orig, tok, "vanilla")
    questions = {q.question_id: q for q in load_questions(a.dataset)}
    print("method | answers | tokens | log p / token: original, other | entropy / token: original, other")
    for label in a.methods.split(","):
        recs = [json.loads(x) for x in (Path(a.run) / "raw" / f"{safe_name(label)}.jsonl").read_text().splitlines()]
        recs = [r for r in recs if r["turn"] == 0 and r["tokens"]][: a.limit or None]
        tot = torch.zeros(5, dtype=torch.float64)
        for r in recs:
            prompt = enc.encode([{"role": "user", "content": questions[r["question_id"]].turns[0]}])
            (lo, ho), (lx, hx) = score(orig, prompt, r["tokens"]), score(other, prompt, r["tokens"])
            tot += torch.tensor([len(r["tokens"]), lo, lx, ho, hx], dtype=torch.float64)
        n, per = int(tot[0]), [f"{float(x) / float(tot[0]):.3f}" for x in tot[1:]]
        print(f"{label} | {len(recs)} | {n} | {per[0]}, {per[1]} | {per[2]}, {per[3]}")


if __name__ == "__main__":
    main()
