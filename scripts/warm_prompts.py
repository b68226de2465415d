"""vanilla and other methods (default: auto, fspad, hydra; or the names given as arguments) in one warm
process on the README demo prompt and three prompts no head or cost table was tuned on: tok/s, the ratio to
vanilla, tau, and whether every method's output is the same."""

import sys
import time

import torch

from specdec.api import load

torch.set_num_threads(2)
prompts = ["Explain in a few sentences why the sky is blue.",
           "Write a short note to a neighbour asking them to water my plants while I am away.",
           "List three ways to keep a sourdough starter healthy.",
           "What is the difference between a list and a tuple in Python?"]
decs = {m: load("smollm2", m) for m in ("vanilla", *(sys.argv[1:] or ("auto", "fspad", "hydra")))}
for d in decs.values():
    d.generate([{"role": "user", "content": "Hi"}], max_new_tokens=16)
res = {m: [0.0, 0, []] for m in decs}
texts = {}
for p in prompts:
    for m, d in decs.items():
        t = time.perf_counter()
        r = d.generate([{"role": "user", "content": p}], max_new_tokens=128)
        res[m][0] += time.perf_counter() - t
        res[m][1] += len(r.token_ids)
        res[m][2].append(r.stats.tau)
        texts.setdefault(p, set()).add(tuple(r.token_ids))
        if p == prompts[0]:
            print(m, "demo prompt", f"{len(r.token_ids)/(time.perf_counter()-t):.1f} tok/s tau {r.stats.tau:.2f}")
base = res["vanilla"][1] / res["vanilla"][0]
for m, (s, n, taus) in res.items():
    print(f"{m:8s} {n/s:6.1f} tok/s  {n/s/base:.2f}x  tau {sum(taus)/len(taus):.2f}")
print("identical outputs per prompt:", all(len(v) == 1 for v in texts.values()))
