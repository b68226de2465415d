"""`specdec datagen`: the command line of training/datagen.py (flags, checks before the model loads)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.options import add_flags, arg_type, flag_values, one_line_errors
from specdec.runtime.loading import Runtime, load_model, resolve
from specdec.training.datagen import (
    _DTYPES,
    PLAN_RULES,
    SOURCES,
    Plan,
    aux_layer_list,
    check_run,
    run_ranks,
    source_list,
    temperature_list,
)
from specdec.training.dist import init, rank_world
from specdec.training.shards import MANIFEST, merge_manifests


def add_parser(sub) -> None:
    p = one_line_errors(sub.add_parser("datagen", help="self-distillation data for draft heads (resumable "
                                       "safetensors shards)"))
    d = Plan()
    p.add_argument("--model", default=None, metavar="PATH", help="the target: HF dir, .gguf, or smollm2 (default: "
                   "the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory, checked writable before the "
                   "model loads (re-run the same command to resume)")
    p.add_argument("--shards", type=arg_type(int, ge=1), default=None, metavar="N",
                   help="total shards wanted (existing ones are skipped); required unless --merge. Under "
                   "torchrun / accelerate launch (RANK, WORLD_SIZE) process r makes shards i with i %% WORLD_SIZE "
                   "== r, and rank 0 writes the one manifest once all are done")
    p.add_argument("--merge", action="store_true", help="only fold the per-process manifests of a run across "
                   "processes into manifest.json (after a run whose processes did not all finish), no model "
                   "(default: off)")
    p.add_argument("--shard-size", type=PLAN_RULES["shard_size"], default=d.shard_size, metavar="N",
                   help=f"sequences per shard (default {d.shard_size})")
    p.add_argument("--batch-size", type=arg_type(int, ge=1), default=64, metavar="N",
                   help="sequences generated together (default 64, docs/training.md's measured recipe)")
    p.add_argument("--sources", type=source_list, default=",".join(d.sources), metavar="SRC[,SRC...]",
                   help=f"prompt sources, cycled per shard: {', '.join(SOURCES)} (default {','.join(d.sources)})")
    p.add_argument("--temperatures", type=temperature_list, default=",".join(f"{t:g}" for t in d.temperatures),
                   metavar="T[,T...]", help="sampling temperatures of the answers, cycled per round of sources "
                   f"(default {','.join(f'{t:g}' for t in d.temperatures)})")
    p.add_argument("--top-p", type=PLAN_RULES["top_p"], default=d.top_p, metavar="X",
                   help=f"nucleus sampling of the answers at T > 0 (default {d.top_p:g}: off)")
    p.add_argument("--max-new-tokens", type=PLAN_RULES["max_new_tokens"], default=d.max_new_tokens, metavar="N",
                   help=f"answer tokens at most (default {d.max_new_tokens})")
    p.add_argument("--max-prompt-tokens", type=PLAN_RULES["max_prompt_tokens"], default=d.max_prompt_tokens,
                   metavar="N", help=f"a longer prompt keeps its last N tokens (default {d.max_prompt_tokens})")
    p.add_argument("--gsm8k", default=None, metavar="PATH", help="GSM8K train.jsonl (default: gsm8k/train.jsonl "
                   "under $SPECDEC_DATA, else the copy shipped with the package)")
    p.add_argument("--exclude-dir", default=None, metavar="DIR", help="another benchmark data dir (same layout) "
                   "whose prompts are excluded, besides $SPECDEC_DATA's and the package's (default: none)")
    p.add_argument("--tokens-only", action="store_true", help="store token ids and loss masks alone (~5 bytes a "
                   "token: small enough to keep in a repository); `train` computes the target's features from "
                   "them (default: off, features stored: ~1.2 KB a token at H = 576)")
    p.add_argument("--feature-dtype", default="float16", choices=list(_DTYPES),
                   help="dtype of the stored features (default float16)")
    p.add_argument("--seed", type=PLAN_RULES["seed"], default=d.seed, metavar="N",
                   help=f"picks the GSM8K order and the samples; one per parallel process (default {d.seed})")
    p.add_argument("--aux-layers", type=aux_layer_list, default=d.aux_layers, metavar="LAYERS",
                   help="also store the hidden state entering these layers: 'eagle3' (2, L/2, L-3; what an "
                   f"EAGLE-3 head trains on), comma-separated indices, or 'none' (default {d.aux_layers})")
    add_flags(p, Runtime, only=("threads", "device"))
    p.set_defaults(func=cmd_datagen)


def cmd_datagen(args) -> int:
    if args.merge:
        out = Path(args.out)
        if not out.is_dir():
            raise SpecdecError(f"--out {out}: no such directory to merge")
        print(f"datagen: {out / MANIFEST} lists {merge_manifests(out)} shards")
        return 0
    if args.shards is None:
        raise SpecdecError("--shards is required (unless --merge)")
    rank, world = rank_world()
    rt = Runtime.parse(flag_values(args, Runtime))
    plan = Plan(shard_size=args.shard_size, sources=args.sources, temperatures=args.temperatures,
                max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, top_p=args.top_p,
                seed=args.seed, aux_layers=args.aux_layers)
    check_run(args.out, args.shards, plan, args.batch_size, args.gsm8k, args.exclude_dir, args.feature_dtype)
    resolve(args.model)
    rt.apply()
    init(world)
    model, tok, _ = load_model(args.model, rt.device, torch.float32 if rt.device in (None, "cpu") else None)
    t = run_ranks(model, tok, args.out, args.shards, plan, batch_size=args.batch_size, gsm8k=args.gsm8k,
                  exclude_dir=args.exclude_dir, feature_dtype=args.feature_dtype, tokens_only=args.tokens_only)
    gen = t["gen_seconds"]
    who = "" if world == 1 else f" (rank {rank} of {world})"
    print(f"datagen{who}: {t['shards']} new shards, {t['sequences']} sequences, {t['tokens']} tokens "
          f"({t['answer_tokens']} answer tokens) in {t['seconds']:.0f} s; generation "
          f"{t['answer_tokens'] / gen if gen else 0:.0f} tok/s")
    return 0
