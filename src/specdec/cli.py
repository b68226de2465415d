"""`specdec` command line. Errors users can fix are printed as one line, without a traceback."""

from __future__ import annotations

import argparse
import sys

from specdec.api import load
from specdec.bench.cli import add_bench_parser
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.training import datagen, train
from specdec.tune import cli as tune_cli

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="auto", help=f"one of: {', '.join(registry.names())} (default auto; "
                   "`specdec methods` lists them with their options)")
    p.add_argument("--draft", default=None, help="draft model for sps / sps-tree (same tokenizer)")
    # one flag per method option, declared once in the registry; the method's options class checks the value
    for key, (f, alias) in _option_flags().items():
        p.add_argument("--" + key.replace("_", "-"), dest=f"opt_{key}", default=None, metavar="V",
                       help=argparse.SUPPRESS if alias else f.metadata["help"])
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="any method option, e.g. --opt chain_len=6 (repeatable)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _option_flags() -> dict:
    """Every option name and alias of every method -> (its field, whether it is an alias)."""
    out: dict = {}
    for m in registry.methods().values():
        for f in m.options.fields():
            out.setdefault(f.name, (f, False))
            for a in f.metadata.get("aliases", ()):
                out.setdefault(a, (f, True))
    return out


def _method_opts(args) -> dict:
    opts = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecdecError(f"--opt expects KEY=VALUE, got {item!r}")
        opts[key.replace("-", "_")] = value  # a string: the method's options class converts and checks it
    return opts


def cmd_generate(args) -> int:
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
    print(
        f"\n[{dec.drafter.name}] {s.new_tokens} tokens in {s.total_time:.2f} s = {s.tokens_per_second:.1f} tok/s | "
        f"tau {s.tau:.2f} (tokens per target forward, prefill excluded) | {s.target_forwards} target forwards | "
        f"draft {s.draft_time:.2f} s, verify {s.verify_time:.2f} s, prefill {s.prefill_time:.2f} s | "
        f"finish: {final.finish_reason}",
        file=sys.stderr,
    )
    return 0


def cmd_methods(args) -> int:
    sys.stdout.write(registry.markdown_table())
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
    m = sub.add_parser("methods", help="the drafting methods and their options (a Markdown table)")
    m.set_defaults(func=cmd_methods)
    datagen.add_parser(sub)
    train.add_parser(sub)
    tune_cli.add_parser(sub)
    add_bench_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
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
