"""Compare EAGLE heads by their exact greedy acceptance on `specdec tune`'s calibration prompts, for
fixed tree shapes (depths × sizes at one top-k). Acceptance only: no timing, so it is cheap and exact.

    python scripts/compare_heads.py src/specdec/heads/smollm2-135m-instruct-eagle ~/.cache/specdec/runs/v3-ship
"""

from __future__ import annotations

import argparse

import torch

from specdec.api import from_models
from specdec.runtime.loading import load_model
from specdec.tree import TreeBudget
from specdec.tune.cli import CALIBRATION_PROMPTS
from specdec.tune.search import tune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+", help="head directories")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--depths", default="2,3,4,5,6")
    ap.add_argument("--sizes", default="10,16")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = load_model(a.model, "cpu", torch.float32)
    cfgs = [TreeBudget(d, a.topk, m) for d in map(int, a.depths.split(",")) for m in map(int, a.sizes.split(","))
            if d <= m]
    for h in a.heads:
        dec = from_models(model, tok, "eagle2", head=h)
        prompts = [dec.encode([{"role": "user", "content": q}]) for q in CALIBRATION_PROMPTS]
        rows = sorted(tune(dec, prompts, a.tokens, configs=cfgs, reps=2, lookups=())["top"],
                      key=lambda r: (r["tree_size"], r["depth"]))
        print(h)
        print("  " + "  ".join(f"d{r['depth']} m{r['tree_size']}: tau {r['tau']:.2f}" for r in rows), flush=True)


if __name__ == "__main__":
    main()
