"""Vanilla vs auto in one warm process: the README demo prompt and four Spec-Bench prompts auto was not
tuned on (a measurement, not a test).

    python scripts/warm_compare.py
"""

from __future__ import annotations

import json

import torch

from specdec.api import from_models
from specdec.files import find_data
from specdec.target.loading import load_model

DEMO = "Explain in a few sentences why the sky is blue."


def main() -> None:
    torch.set_num_threads(2)
    model, tok, _ = load_model(None, "cpu")
    with open(find_data("spec_bench/question.jsonl")) as f:
        questions = [json.loads(line) for line in f]
    prompts = [DEMO] + [q["turns"][0] for q in questions[120::80]][:4]
    decs = {m: from_models(model, tok, m) for m in ("vanilla", "auto")}
    for d in decs.values():
        d.generate("Hello", max_new_tokens=8)  # warm-up
    for i, p in enumerate(prompts):
        r = {}
        for m in ("vanilla", "auto") if i % 2 == 0 else ("auto", "vanilla"):
            r[m] = decs[m].generate([{"role": "user", "content": p}], max_new_tokens=128)
        v, a = r["vanilla"], r["auto"]
        ratio = a.stats.tokens_per_second / v.stats.tokens_per_second
        print(f"{p[:50]!r:55s} vanilla {v.stats.tokens_per_second:5.1f} tok/s | auto {a.stats.tokens_per_second:5.1f} "
              f"tok/s (tau {a.stats.tau:.2f}) = {ratio:.2f}x | identical {a.token_ids == v.token_ids}")


if __name__ == "__main__":
    main()
