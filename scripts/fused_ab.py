"""The fused per-layer kernels against the same layers' torch ops (a measurement, not a test): one
process, the same streaming linears, toggled per layer and interleaved; 500 cached rows, exact rows.

    python scripts/fused_ab.py
"""

import statistics
import time

import torch

from specdec.runtime.lean import LeanRunner
from specdec.runtime.loading import load_model


def main() -> None:
    torch.set_num_threads(2)
    model, _, _ = load_model(None, "cpu")
    r = LeanRunner(model)
    ops = r.fused
    if ops is None:
        raise SystemExit("the fused kernels are not available on this machine")
    ids = torch.randint(0, 40000, (600,), generator=torch.Generator().manual_seed(0))
    r.forward(ids[:500], logits_rows=slice(-1, None))
    r.commit(range(500))

    def use(on: bool) -> None:
        for b in r.layers:
            b.fused = ops if on else None
        r.fused = ops if on else None

    res: dict = {}
    for rep in range(8):
        for on in (True, False):
            use(on)
            for n in (1, 8, 16):
                t = time.perf_counter()
                for _ in range(5):
                    r.forward(ids[500:500 + n])
                    r.rollback()
                if rep:  # the first round warms up
                    res.setdefault((on, n), []).append((time.perf_counter() - t) / 5 * 1e3)
    for n in (1, 8, 16):
        a, b = statistics.median(res[(True, n)]), statistics.median(res[(False, n)])
        print(f"N={n}: fused {a:.1f} ms, torch ops {b:.1f} ms, ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
