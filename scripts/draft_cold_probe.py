"""What a drafted step's propose() costs warm (back to back, as a naive probe times it) and right after a
target forward (as in decoding: the forward evicts the head from the caches), for the shipped head's
sampled-children trees at T = 1 (a measurement, not a test).

    python scripts/draft_cold_probe.py
"""

from __future__ import annotations

import time

import torch

from specdec.api import from_models
from specdec.drafters.base import DecodeContext
from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams
from specdec.verify import Verdict


def main() -> None:
    torch.set_num_threads(2)
    model, tok, _ = load_model(None, "cpu")
    dec = from_models(model, tok, "auto")
    runner, eagle = dec.runner, dec.drafter.eagle
    ids = torch.randint(0, 1000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.reset()
    feats = runner.forward(torch.tensor(ids), logits_rows=slice(-1, None)).features
    runner.reset()
    ctx = DecodeContext(ids[:385], SamplingParams(1.0), torch.Generator().manual_seed(0), 384, feats[:384])
    eagle.begin(ctx)
    pos = [385]

    def advance() -> None:  # one step: an accepted token + the bonus for the head to read
        p = pos[0]
        ctx.tokens += ids[p:p + 2]
        ctx.features = feats[p - 1:p + 1]
        pos[0] += 2
        eagle.accept(ctx, Verdict([0], ctx.tokens[-2:], ctx.tokens[-1]))

    def ms(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def evict() -> None:
        runner.forward(torch.tensor(ids[:1]), logits_rows=slice(-1, None))
        runner.reset()

    print(f"{'budget (d, k, m)':18s} {'warm sync':>10s} {'warm tree':>10s} {'after a forward':>16s}")
    for b, _ in dec.drafter.sampled[:4]:
        warm_sync, warm_tree, cold = [], [], []
        for _ in range(4):
            advance()
            warm_sync.append(ms(lambda: eagle.sync(ctx)))
            warm_tree.append(ms(lambda: eagle.propose(ctx, b)))
            advance()
            evict()
            cold.append(ms(lambda: eagle.propose(ctx, b)))  # reads the step's rows, then drafts
        print(f"{str(tuple(b.__dict__.values())):18s} {min(warm_sync):10.2f} {min(warm_tree):10.2f} {min(cold):16.2f}")


if __name__ == "__main__":
    main()
