"""The `specdec` subcommands (the package's __init__ is the entry point: it runs them and reports errors
and Ctrl-C)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import select
import sys
import warnings
from pathlib import Path

from specdec.api import DEFAULT_PROMPT, GenerationParams, check_text, load
from specdec.bench.cli import add_bench_parser
from specdec.cli import interop as interop_cli
from specdec.cli import medusa as medusa_cli
from specdec.cli.chat import repl
from specdec.cli.output import detail_line, end_answer, say, write_answer
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.options import add_flags, arg_type, flag_values, one_line_errors
from specdec.runtime.cpus import ContentionMeter
from specdec.runtime.loading import Runtime, resolve
from specdec.serve.engine import Serving
from specdec.training import datagen_cli, train_cli
from specdec.tune import cli as tune_cli


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


def _add_answer_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that answer: model, method, sampling, runtime, system message, noise."""
    p.add_argument("--system", default=None, help="system message for the chat template")
    _add_model(p)
    add_flags(p, GenerationParams, skip=FILE_CONSTRAINTS)
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="the answer is JSON fitting the JSON schema in FILE")
    p.add_argument("--grammar", metavar="FILE", default=None,
                   help="the answer follows the Lark (or llama.cpp GBNF) grammar in FILE")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("-q", "--quiet", action="store_true", help="nothing on stderr but errors: no statistics "
                       "line, no notes")
    noise.add_argument("-v", "--verbose", action="store_true", help="also what the drafter chose and how its "
                       "drafts fared (acceptance by depth, draft sizes, costs), and the libraries' warnings "
                       "and progress bars")


FILE_CONSTRAINTS = ("json_schema", "grammar")  # constraints the command line reads from a file


def read_text_file(path: str, flag: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecdecError(f"{flag}: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{flag}: cannot read {path}: {e}") from None
    if not text.strip():
        raise SpecdecError(f"{flag}: {path} is empty")
    return text


CONTENDED = 0.25  # share of the CPUs other processes used during a generation that the stats line reports
STDIN_WAIT_S = 0.5  # a pipe that has sent nothing by then is not a prompt (pass "-" to wait for it)


def read_prompt(arg: str | None, quiet: bool = False) -> str:
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
        if not quiet:
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


def quiet_libraries(verbose: bool) -> None:
    """Library noise off for a command that answers on the terminal: transformers' `Loading weights` bar
    and logs, and other libraries' FutureWarning/UserWarning (specdec's own warnings stay). -v keeps
    them all. Called by the generate and chat commands only, not at import of the library."""
    if verbose:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # also huggingface_hub's download bars
    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, message=r"(?!specdec)")


def _answer_setup(args):
    """What generate and chat share, checked before the slow model load: the sampling parameters, the
    runtime, the method and its options, the system message. Returns (params, runtime, method options)."""
    given = flag_values(args, GenerationParams)
    for name in FILE_CONSTRAINTS:
        path = getattr(args, name)
        if path is not None:
            given[name] = read_text_file(path, "--" + name.replace("_", "-"))
    params = GenerationParams.parse(given)
    rt = Runtime.parse(flag_values(args, Runtime))
    if args.system is not None:
        check_text(args.system, "--system")
    opts = _method_opts(args)
    registry.parse(args.method, opts)
    resolve(args.model)  # a missing model is said before anything else (the thread note included)
    if args.draft is not None:
        resolve(args.draft, "--draft")
    return params, rt, opts


def _load(args, rt: Runtime, opts: dict):
    if args.quiet:
        warnings.simplefilter("ignore")  # -q: nothing on stderr but errors
    quiet_libraries(args.verbose)
    note = rt.apply()  # the threads: as given, or what other processes leave free now (and followed)
    if note:
        say(args, f"specdec: {note}")
    return load(args.model, args.method, draft=args.draft, device=rt.device, dtype=rt.dtype, backend=rt.backend,
                threads=rt.threads, weights=rt.weights, **opts)


def cmd_generate(args) -> int:
    params, rt, opts = _answer_setup(args)  # everything is checked before the slow model load
    prompt = read_prompt(args.prompt, quiet=args.quiet)
    dec = _load(args, rt, opts)
    if not args.raw:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = msgs + [{"role": "user", "content": prompt}]
    final = None
    meter = ContentionMeter()
    for chunk in dec.stream(prompt, **params.model_dump()):
        if not args.json:
            write_answer(chunk.text)
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
    end_answer()
    say(args,
        f"[{dec.drafter.name}, {dec.weights} weights{f', {s.kernels} kernels' if s.kernels else ''}] "
        f"{s.new_tokens} tokens in {s.total_time:.2f} s = "
        f"{s.tokens_per_second:.1f} tok/s | "
        f"tau {s.tau:.2f} (tokens per target forward, prefill excluded) | {s.target_forwards} target forwards"
        f"{f' ({s.vanilla_share:.0%} without a draft)' if s.vanilla_share else ''} | "
        f"draft {s.draft_time:.2f} s, verify {s.verify_time:.2f} s, prefill {s.prefill_time:.2f} s | "
        f"finish: {final.finish_reason}{f' | costs {s.costs}' if s.costs else ''}"
        f"{f' | acceptance {s.acceptance}' if s.acceptance != 'lossless' else ''}{load_note}")
    if args.verbose:
        say(args, detail_line(s))
    return 0


def cmd_chat(args) -> int:
    params, rt, opts = _answer_setup(args)
    dec = _load(args, rt, opts)
    return repl(dec, params, args)


def cmd_serve(args) -> int:
    rt = Runtime.parse(flag_values(args, Runtime))  # everything is checked before the slow model load
    sv = Serving.parse(flag_values(args, Serving))
    opts = _method_opts(args)
    registry.parse(args.method, opts)
    resolve(args.model)
    if args.draft is not None:
        resolve(args.draft, "--draft")
    try:
        from specdec.serve.app import serve  # fastapi and uvicorn: the optional `serve` extra
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the serve extra (pip install 'specdec[serve]'): {e}") from None
    args.quiet, args.verbose = False, False
    dec = _load(args, rt, opts)
    serve(dec, args.model or "smollm2", host=args.host, port=args.port, max_queue=sv.max_queue,
          max_batch=sv.max_batch, prefill_chunk=sv.prefill_chunk, prefill_stall=sv.prefill_stall)
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
    ap = one_line_errors(argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding."))
    ap.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer, streaming, with statistics")
    g.add_argument("prompt", nargs="?", default=None, help='the prompt; "-" or a pipe: read it from stdin')
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, statistics) "
                   "instead of the streamed text and the statistics line")
    _add_answer_flags(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="an interactive conversation: the model loads once, answers stream",
                       description="Type a message, Enter to send. /reset clears the history, /exit or "
                       "Ctrl-D quits; Ctrl-C stops an answer (at the prompt: quits). Lines piped in are turns.")
    c.add_argument("--color-draft", action="store_true", help="colour each token by how it was produced: "
                   "sampled by the target, or an accepted draft token (by its depth)")
    _add_answer_flags(c)
    c.set_defaults(func=cmd_chat)
    s = one_line_errors(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health, /metrics)"))
    _add_model(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=arg_type(int, ge=1, le=65535), default=8000, help="port (default 8000)")
    add_flags(s, Serving, early=True)
    s.set_defaults(func=cmd_serve)
    m = sub.add_parser("methods", help="the drafting methods and their options (a Markdown table)")
    m.set_defaults(func=cmd_methods)
    datagen_cli.add_parser(sub)
    train_cli.add_parser(sub)
    tune_cli.add_parser(sub)
    medusa_cli.add_parser(sub)
    interop_cli.add_parser(sub)
    add_bench_parser(sub)
    return ap


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
