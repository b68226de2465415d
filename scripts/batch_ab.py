"""Continuous batching in one process, without a server: vanilla, `auto` pricing its rows as if decoding
alone, and `auto` pricing them as its share of the packed forward (Costs.shared), each a Batch of its own
over the same MT-bench first turns, stepping in turn (one step of each, then again), so the three see the
same machine. Prints tokens per second and the ratios; at T = 0 checks the three gave the same tokens.
`--long N`: N of the long-context set's 2k and 4k prompts spread among them (as `bench serve --long`);
`--stall`: the batches' prefill stall budget (batch.PromptRows; 0: chunks of the step's rows).

    python scripts/batch_ab.py --batch 4 --prompts 16 --temperature 0
    python scripts/batch_ab.py --batch 4 --prompts 24 --long 3 --stall 0
"""
import argparse
import collections
import statistics
import time

import torch

from specdec.api import load
from specdec.batch import STALL, Batch
from specdec.bench.data import MT_BENCH_CATEGORIES, load_questions
from specdec.bench.load import long_prompts, with_long
from specdec.sampling import SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--prompts", type=int, default=16)
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--max-new-tokens", type=int, default=256)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--long", type=int, default=0)
p.add_argument("--stall", type=float, default=STALL)
args = p.parse_args()
torch.set_num_threads(args.threads)

plain = load("smollm2", "vanilla", threads=args.threads)
auto = load("smollm2", "auto", threads=args.threads)
qs = [q for q in load_questions("spec_bench") if q.category in MT_BENCH_CATEGORIES][:args.prompts]
texts = [q.turns[0] for q in qs] + long_prompts(None)
order = [k for _, k in with_long([("ok", i) for i in range(len(qs))], len(qs), len(texts) - len(qs), args.long)]
prompts = [plain.encode([{"role": "user", "content": texts[k]}]) for k in order]
names = ["vanilla", "auto, rows priced alone", "auto"]
batches = [Batch(plain.runner, plain.drafter, plain.eos_ids, stall=args.stall),
           Batch(auto.runner, auto.drafter, auto.eos_ids, stall=args.stall),
           Batch(auto.runner, auto.drafter, auto.eos_ids, stall=args.stall)]
forwards = collections.defaultdict(list)  # packed rows -> seconds, over all three


def timed(batch: Batch) -> None:
    run = batch.runner.forward_many

    def forward_many(parts, aux_layers=(), logits_rows=None):
        t = time.perf_counter()
        out = run(parts, aux_layers, logits_rows)
        forwards[sum(p[1].numel() for p in parts)].append(time.perf_counter() - t)
        return out

    batch.runner.forward_many = forward_many


for b in batches:
    timed(b)
todo = [list(range(len(prompts))) for _ in batches]
owner = [{} for _ in batches]
out = [{} for _ in batches]
secs = [0.0] * len(batches)
while any(t or len(b) for t, b in zip(todo, batches)):
    for i, b in enumerate(batches):
        if not (todo[i] or len(b)):
            continue
        t0 = time.perf_counter()
        while todo[i] and len(b) < args.batch:
            k = todo[i].pop(0)
            seq = b.join(prompts[k], SamplingParams(args.temperature, seed=k), args.max_new_tokens)
            if i == 1:  # its drafter prices rows as a lone sequence's
                seq.drafter.share = lambda ctx: None
            owner[i][seq], out[i][k] = k, []
        results = b.step()
        secs[i] += time.perf_counter() - t0
        for seq, new in results:
            if isinstance(new, list):
                out[i][owner[i][seq]] += new
tokens = [sum(map(len, o.values())) for o in out]
rates = [n / s for n, s in zip(tokens, secs)]
print(f"batch {args.batch}, {len(prompts)} prompts ({args.long} long), stall {args.stall:g}, T = {args.temperature:g}" +
      (f", same tokens: {out[0] == out[1] == out[2]}" if args.temperature == 0 else ""))
for name, r in zip(names, rates):
    print(f"  {name}: {r:.1f} tok/s, {r / rates[0]:.3f}x vanilla")
print("  packed forwards: " + ", ".join(f"t({n}) {statistics.median(v) * 1e3:.1f} ms"
                                        for n, v in sorted(forwards.items()) if len(v) >= 5))
