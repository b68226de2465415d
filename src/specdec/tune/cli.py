"""`specdec tune`: measure on this machine, choose, and write the choice where `eagle2`/`auto` find it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from specdec.api import from_models
from specdec.drafters.auto import beside_head, ngram_key
from specdec.errors import SpecdecError
from specdec.files import check_writable
from specdec.heads.shipped import find_shipped_head
from specdec.options import add_flags, flag_values
from specdec.runtime import threads
from specdec.runtime.cpus import cpu_name
from specdec.runtime.loading import Runtime, load_model, resolve
from specdec.tune.lookup import lookup_rates
from specdec.tune.sampled import choose_sampled, sampled_acceptance
from specdec.tune.search import LOOKUPS, SIZES, tune
from specdec.tuning import save_tuning, tuning_path

LOOKUP_SEEDS = 2  # sampled answers per prompt behind the T = 1 lookup rates

# generic chat requests; none is a Spec-Bench / MT-bench / HumanEval prompt (those are for measuring)
CALIBRATION_PROMPTS = (
    "Explain how the gears on a bicycle make it easier to ride up a hill.",
    "Write a short, polite email asking a colleague to move our Tuesday meeting to Thursday.",
    "Give me five tips for keeping houseplants healthy, one sentence each.",
    "What is the difference between a list and a tuple in Python? Show a small example.",
    "Describe the water cycle so that a ten-year-old can follow it.",
    "Write a Python function that reads a CSV file and returns the average of one of its columns.",
    "What are the advantages and drawbacks of working from home? Answer in one paragraph.",
    "Give me a simple recipe for pancakes, with quantities.",
)


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="pick the EAGLE-2 tree budget (depth, topk, tree_size) for this machine")
    p.add_argument("--model", default=None, metavar="PATH", help="the target: HF dir, .gguf, or smollm2 "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, metavar="PATH", help="EAGLE head dir (default: the one shipped for the "
                   "model)")
    p.add_argument("--prompts", type=int, default=4, metavar="N",
                   help=f"calibration prompts, 1-{len(CALIBRATION_PROMPTS)} (default 4)")
    p.add_argument("--tokens", type=int, default=256, metavar="N",
                   help="greedy tokens generated per prompt, as long as real answers: a small model repeats "
                        f"itself late in an answer, which is where a lookup chain pays; at least {2 + max(SIZES)} "
                        "(default 256)")
    add_flags(p, Runtime, only=("threads",))  # tune with the count you will use
    p.add_argument("--out", default=None, metavar="PATH", help="result file (default: <head>/tuning.json; for a "
                   "shipped or read-only head ~/.cache/specdec/tuning/<name>.json, where loading also looks)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="table rows to print (default 10)")
    p.add_argument("--lookups", default=",".join(map(str, LOOKUPS)), metavar="N[,N...]",
                   help="prompt-lookup chain lengths to try joined with the tree, for `auto`; '' = none "
                        f"(default {','.join(map(str, LOOKUPS))})")
    p.add_argument("--sampled-tokens", type=int, default=128, metavar="N",
                   help="tokens sampled per prompt (T = 1) to measure each tree's acceptance with sampled "
                        "children, which adaptive `auto` drafts for sampled requests; 0: skip, ~2 min "
                        "(default 128)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    rt = Runtime.parse(flag_values(args, Runtime))
    if not 1 <= args.prompts <= len(CALIBRATION_PROMPTS):
        raise SpecdecError(f"--prompts must be 1-{len(CALIBRATION_PROMPTS)}, got {args.prompts}")
    if args.tokens < 2 + max(SIZES):
        raise SpecdecError(f"--tokens must be >= {2 + max(SIZES)} (room to time the largest tree), got {args.tokens}")
    if args.sampled_tokens < 0:
        raise SpecdecError(f"--sampled-tokens must be >= 0, got {args.sampled_tokens}")
    if args.top < 1:
        raise SpecdecError(f"--top must be >= 1, got {args.top}")
    if args.head is not None and not os.path.isdir(args.head):
        raise SpecdecError(f"--head {args.head!r} is not a directory")
    if args.out is not None:  # the result is written after minutes of measuring: its place is checked first
        if os.path.isdir(args.out):
            raise SpecdecError(f"--out {args.out} is a directory: give a file name")
        check_writable(Path(args.out).expanduser().parent, f"--out {args.out}:")
    resolve(args.model)
    try:
        lookups = [int(x) for x in args.lookups.split(",") if x.strip()]
    except ValueError:
        raise SpecdecError(f"--lookups must be comma-separated token counts, got {args.lookups!r}") from None
    if any(n < 1 for n in lookups):
        raise SpecdecError(f"--lookups must be >= 1 each, got {args.lookups!r}")
    rt.apply()
    threads.fix(torch.get_num_threads())  # costs are timed (and cached) per count: one count for the run
    model, tok, _ = load_model(args.model, "cpu", torch.float32)
    head = args.head or find_shipped_head(model, "eagle3") or find_shipped_head(model)
    if head is None:
        raise SpecdecError("no EAGLE head ships for this model: pass --head DIR "
                           "(train one with `specdec datagen` + `specdec train eagle`)")
    from specdec.heads.io import is_eagle3_dir  # transformers' model code: only once a head is tuned

    # explicit eagle2 / eagle3: never a union
    dec = from_models(model, tok, "eagle3" if is_eagle3_dir(head) else "eagle2", head=str(head))
    prompts = []
    for q in CALIBRATION_PROMPTS[:args.prompts]:
        try:
            prompts.append(dec.encode([{"role": "user", "content": q}]))
        except SpecdecError:  # no chat template: plain completion
            prompts.append(dec.encode(q))
    log = lambda s: print(s, file=sys.stderr, flush=True)
    log(f"tuning {head} on {cpu_name()}, {torch.get_num_threads()} threads")
    rec = tune(dec, prompts, args.tokens, log=log, lookups=lookups)
    if args.sampled_tokens:
        rec["acceptance_sampled"] = sampled_acceptance(dec, prompts, args.sampled_tokens, log=log)
        rec["acceptance_sampled_calibration"] = {"prompts": len(prompts), "tokens": args.sampled_tokens,
                                                 "temperature": 1.0, "seeds": f"0-{len(prompts) - 1}"}
        # priced with the greedy trees' forward table (its sizes, 1..33, cover every sampled tree)
        rec["sampled"] = choose_sampled(rec["acceptance_sampled"], rec["target_ms"])
    ngram = lambda: beside_head(rec["auto"].get("lookup"))  # what `auto` drafts beside the head with this file
    rec["lookup_rates"] = {"drafter": ngram_key(ngram()), "greedy": lookup_rates(dec, prompts, args.tokens, ngram)}
    if args.sampled_tokens:
        rec["lookup_rates"]["sampled"] = lookup_rates(dec, prompts, args.sampled_tokens, ngram, 1.0, LOOKUP_SEEDS)
    log(f"lookup nodes accepted per confidence bucket: {rec['lookup_rates']}")
    rec["head"] = str(Path(head).resolve())
    out = save_tuning(rec, args.out or tuning_path(head))
    print(f"{'depth':>5} {'topk':>4} {'size':>4} {'tau':>6} {'draft ms':>9} {'target ms':>9} {'tok/s':>7}")
    for r in rec["top"][:args.top]:
        print(f"{r['depth']:>5} {r['topk']:>4} {r['tree_size']:>4} {r['tau']:>6.2f} {r['draft_ms']:>9.2f} "
              f"{r['target_ms']:>9.2f} {r['tokens_per_second']:>7.1f}")
    print(f"chosen: depth {rec['depth']}, topk {rec['topk']}, tree_size {rec['tree_size']} "
          f"(tau {rec['tau']:.2f}, ~{rec['tokens_per_second']:.1f} tok/s expected vs "
          f"~{rec['vanilla_tokens_per_second']:.1f} vanilla; drafter update {rec['follow_ms']:.2f} ms/step)")
    a = rec["auto"]
    if a.get("lookup"):
        print(f"auto: the same with a {a['lookup']}-token prompt-lookup chain in the tree: depth {a['depth']}, "
              f"topk {a['topk']}, tree_size {a['tree_size']} (tau {a['tau']:.2f}, "
              f"~{a['tokens_per_second']:.1f} tok/s expected)")
    else:
        print("auto: eagle2 as chosen (no prompt-lookup chain gained)")
    if "sampled" in rec:
        s = rec["sampled"]
        print(f"sampled requests (children drawn from the draft): depth {s['depth']}, topk {s['topk']}, "
              f"tree_size {s['tree_size']} (T = 1 tau {s['tau']:.2f}, {s['tokens_per_second']:.1f} tok/s expected)")
    if rec["tokens_per_second"] < rec["vanilla_tokens_per_second"]:
        print("note: no tree beats plain decoding here: the head's acceptance is too low for its cost")
    print(f"written to {out}")
    return 0
