"""`specdec` command line. Errors users can fix are printed as one line, without a traceback."""

from __future__ import annotations

import argparse
import sys

from specdec.errors import SpecdecError

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="auto",
                   help="auto (default: eagle2 with the shipped head where one fits the target, else vanilla) | "
                        "vanilla | sps | sps-tree | pld | eagle | eagle2")
    p.add_argument("--draft", default=None, help="draft model for sps / sps-tree (same tokenizer)")
    p.add_argument("--gamma", type=int, default=None, help="draft length (chain) or depth (tree)")
    p.add_argument("--topk", type=int, default=None, help="children per expanded node (trees)")
    p.add_argument("--tree-tokens", type=int, default=None, help="nodes kept in the tree")
    p.add_argument("--head", default=None, help="EAGLE head dir for eagle / eagle2 (default: the shipped one)")
    p.add_argument("--rank-by", default=None, choices=["value", "confidence"], help="eagle2 expansion ranking")
    p.add_argument("--no-rerank", dest="rerank", action="store_false", default=None, help="eagle2 ablation")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="any other method option, e.g. --opt num_tokens=6 (repeatable)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _method_opts(args) -> dict:
    names = {"gamma": args.gamma, "topk": args.topk, "tree_tokens": args.tree_tokens}
    names.update(head=args.head, rank_by=args.rank_by, rerank=args.rerank)
    opts = {k: v for k, v in names.items() if v is not None}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecdecError(f"--opt expects KEY=VALUE, got {item!r}")
        opts[key.replace("-", "_")] = _literal(value)
    return opts


def _literal(value: str):
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def cmd_generate(args) -> int:
    from specdec.api import load
    from specdec.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # fail before a slow model load
    dec = load(args.model, args.method, draft=args.draft, device=args.device, backend=args.backend,
               threads=args.threads, **_method_opts(args))
    prompt = args.prompt or DEFAULT_PROMPT
    if not args.raw:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = msgs + [{"role": "user", "content": prompt}]
    final = None
    for chunk in dec.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop=args.stop or None, seed=args.seed):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        final = chunk.final
    s = final.stats
    label = dec.drafter.name if "+" in dec.drafter.name else dec.method  # a union names its members
    print(
        f"\n[{label}] {s.new_tokens} tokens in {s.total_time:.2f} s = {s.tokens_per_second:.1f} tok/s | "
        f"tau {s.tau:.2f} (tokens per target forward, prefill excluded) | {s.target_forwards} target forwards | "
        f"draft {s.draft_time:.2f} s, verify {s.verify_time:.2f} s, prefill {s.prefill_time:.2f} s | "
        f"finish: {final.finish_reason}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer, streaming, with statistics")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_model(g)
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)
    from specdec import tune
    from specdec.training import datagen, train

    datagen.add_parser(sub)
    train.add_parser(sub)
    tune.add_parser(sub)
    from specdec.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from specdec.errors import SpecdecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
