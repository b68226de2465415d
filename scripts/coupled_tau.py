"""τ of eagle2 at T=1, sampled and top-k children: seeded requests (the Gumbel coupling: children = top-k of
log q + the coupling's noise) vs unseeded ones (recursive rejection over children drawn from q)."""
import torch

from specdec.api import from_models
from specdec.bench.data import MT_BENCH_CATEGORIES, load_questions
from specdec.runtime.loading import load_model

torch.set_num_threads(1)
model, tok, _ = load_model(None, "cpu")
qs = []  # the first 2 first turns of each of Spec-Bench's six tasks
for q in load_questions("spec_bench"):
    task = "mt_bench" if q.category in MT_BENCH_CATEGORIES else q.category
    if sum(t == task for t, _ in qs) < 2:
        qs.append((task, q))
for method, kw in (("eagle2", {"children": "sample"}), ("eagle2", {"children": "topk"})):
    d = from_models(model, tok, method, **kw)
    for coupled in (True, False):
        acc = forwards = 0
        torch.manual_seed(0)
        for i, (_, q) in enumerate(qs):
            g = d.generate([{"role": "user", "content": q.turns[0]}], max_new_tokens=128, temperature=1.0,
                           seed=i if coupled else None)
            acc += sum(g.stats.accept_lengths)
            forwards += len(g.stats.accept_lengths)
        print(f"{method} children={kw['children']:6s} {'seeded (coupled)' if coupled else 'unseeded (rejection)':22s} "
              f"{len(qs)} prompts: tau {acc / forwards:.3f}", flush=True)
