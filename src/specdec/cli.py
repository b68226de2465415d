"""`specdec` command line. Errors users can fix are printed as one line, without a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import sys

import torch

from specdec.api import GenerationParams, check_text, load
from specdec.bench.cli import add_bench_parser
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.heads import medusa_cli
from specdec.machine import ContentionMeter
from specdec.options import add_flags, flag_values
from specdec.target.loading import Runtime
from specdec.training import datagen, train
from specdec.tune import cli as tune_cli

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="auto", help=f"one of: {', '.join(registry.names())} (default auto; "
                   "`specdec methods` lists them with their options)")
    p.add_argument("--draft", default=None, help="draft model (same tokenizer) for sps / sps-tree, and for auto "
                   "without an EAGLE head, which then also weighs its chains")
    # one flag per method option, declared once in the registry; the method's options class checks the value
    registry.add_option_flags(p)
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="any method option, e.g. --opt chain_len=6 (repeatable)")
    add_flags(p, Runtime)


def _method_opts(args) -> dict:
    opts = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecdecError(f"--opt expects KEY=VALUE, got {item!r}")
        opts[key.replace("-", "_")] = value  # a string: the method's options class converts and checks it
    return opts


CONTENDED = 0.25  # share of the CPUs other processes used during a generation that the stats line reports
STDIN_WAIT_S = 0.5  # a pipe that has sent nothing by then is not a prompt (pass "-" to wait for it)


def read_prompt(arg: str | None) -> str:
    """The prompt argument; "-" (or none, with text piped in) reads stdin; none at all: the demo prompt,
    said so on stderr. Checked before any model loads."""
    if arg == "-" or (arg is None and not sys.stdin.isatty() and _stdin_ready()):
        text = sys.stdin.read()
        if arg is None and not text.strip():  # an empty or closed stdin (a script, /dev/null)
            arg = None
        else:
            check_text(text, "prompt")
            if not text.strip():
                raise SpecdecError("prompt is empty: stdin gave no text")
            return text
    if arg is None:
        print(f"specdec: no prompt given (as an argument, or piped in): answering {DEFAULT_PROMPT!r}",
              file=sys.stderr)
        return DEFAULT_PROMPT
    check_text(arg, "prompt")
    if not arg.strip():  # "" is a mistake to report, not a request for the default prompt
        raise SpecdecError("prompt is empty (omit it for the default prompt)")
    return arg


def _stdin_ready() -> bool:
    try:
        return bool(select.select([sys.stdin], [], [], STDIN_WAIT_S)[0])
    except (OSError, ValueError):  # no selectable stdin (Windows, a closed descriptor)
        return False


def cmd_generate(args) -> int:
    # everything is checked before the slow model load
    params = GenerationParams.parse(flag_values(args, GenerationParams))
    rt = Runtime.parse(flag_values(args, Runtime))
    prompt = read_prompt(args.prompt)
    if args.system is not None:
        check_text(args.system, "--system")
    opts = _method_opts(args)
    registry.parse(args.method, opts)
    note = rt.apply()  # the threads: as given, or what other processes leave free now
    if note:
        print(f"specdec: {note}", file=sys.stderr)
    threads = rt.threads or (torch.get_num_threads() if note else None)
    dec = load(args.model, args.method, draft=args.draft, device=rt.device, dtype=rt.dtype, backend=rt.backend,
               threads=threads, weights=rt.weights, **opts)
    if not args.raw:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = msgs + [{"role": "user", "content": prompt}]
    final = None
    meter = ContentionMeter()
    for chunk in dec.stream(prompt, **params.model_dump()):
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final = chunk.final
    s = final.stats
    busy = meter.result().get("other_cpu_frac") or 0.0
    load_note = (f" | other processes used {busy:.0%} of the CPUs meanwhile: these timings are disturbed"
                 if busy > CONTENDED else "")
    if args.json:  # one object on stdout: the answer, its token ids and every statistic
        record = {"text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
                  "method": args.method, "drafter": dec.drafter.name, "weights": dec.weights,
                  "stats": {**dataclasses.asdict(s), "tau": s.tau, "tokens_per_second": s.tokens_per_second,
                            "other_cpu_frac": busy}}
        print(json.dumps(record, ensure_ascii=False))
        return 0
    sys.stdout.write("\n")  # the answer ends its line on stdout, apart from the statistics on stderr
    sys.stdout.flush()
    print(
        f"[{dec.drafter.name}, {dec.weights} weights] {s.new_tokens} tokens in {s.total_time:.2f} s = "
        f"{s.tokens_per_second:.1f} tok/s | "
        f"tau {s.tau:.2f} (tokens per target forward, prefill excluded) | {s.target_forwards} target forwards"
        f"{f' ({s.vanilla_share:.0%} without a draft)' if s.vanilla_share else ''} | "
        f"draft {s.draft_time:.2f} s, verify {s.verify_time:.2f} s, prefill {s.prefill_time:.2f} s | "
        f"finish: {final.finish_reason}{f' | costs {s.costs}' if s.costs else ''}{load_note}",
        file=sys.stderr,
    )
    return 0


def cmd_methods(args) -> int:
    sys.stdout.write(registry.markdown_table())
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    ap.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer, streaming, with statistics")
    g.add_argument("prompt", nargs="?", default=None, help='the prompt; "-" or a pipe: read it from stdin')
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, statistics) "
                   "instead of the streamed text and the statistics line")
    _add_model(g)
    add_flags(g, GenerationParams)
    g.set_defaults(func=cmd_generate)
    m = sub.add_parser("methods", help="the drafting methods and their options (a Markdown table)")
    m.set_defaults(func=cmd_methods)
    datagen.add_parser(sub)
    train.add_parser(sub)
    tune_cli.add_parser(sub)
    medusa_cli.add_parser(sub)
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
    except BrokenPipeError:  # the reader left (`specdec generate ... | head -2`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 141


if __name__ == "__main__":
    sys.exit(main())
