"""Draft time of EAGLE/FSPAD heads with and without one of the runner's savings, interleaved in one
process: each rep times propose() both ways, alternating which goes first. --ab table: the connector's
token table (heads.runner); --ab tail: PAD heads skipping f's half of down_proj at the tree's last depth.

    python scripts/draft_step_ab.py --heads shipped,~/.cache/specdec/runs/long-fspad/head --trees 2:4:4,3:4:10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec.api import from_models
from specdec.drafters.base import DecodeContext
from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--heads", default="shipped", help="comma list of head dirs ('shipped': the model's own)")
    ap.add_argument("--trees", default="2:4:4,3:4:10", help="comma list of depth:topk:tree_size")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab", choices=("table", "tail"), default="table")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = load_model(a.model, "cpu", torch.float32)
    trees = [TreeBudget(*map(int, t.split(":"))) for t in a.trees.split(",")]
    for h in a.heads.split(","):
        dec = from_models(model, tok, "eagle2", **({} if h == "shipped" else {"head": os.path.expanduser(h)}))
        drafter, head = dec.drafter, dec.drafter.runner
        ids = torch.randint(0, 1000, (a.ctx + 1,), generator=torch.Generator().manual_seed(0)).tolist()
        dec.runner.reset()
        feats = dec.runner.forward(torch.tensor(ids), logits_rows=slice(-1, None)).features
        dec.runner.reset()
        ctx = DecodeContext(ids, SamplingParams(), None, a.ctx, feats[:a.ctx])
        drafter.begin(ctx)
        table, forward, cells = head.token_table, head.forward, []

        def use(saving: bool) -> None:  # the saving on, or off
            if a.ab == "table":
                head.token_table = table if saving else None
            else:
                head.forward = forward if saving else lambda *x, **kw: forward(*x, **{**kw, "feature": True})

        for b in trees:
            ms = {True: [], False: []}
            for rep in range(a.reps):
                for k in (True, False) if rep % 2 else (False, True):
                    use(k)
                    t = time.perf_counter()
                    drafter.propose(ctx, b)
                    ms[k].append((time.perf_counter() - t) * 1e3)
            use(True)
            on, off = statistics.median(ms[True]), statistics.median(ms[False])
            cells.append(f"d{b.depth} k{b.topk} m{b.tree_size}: {off:.3f} -> {on:.3f} ms ({on / off:.3f}x)")
        print(f"{h}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
