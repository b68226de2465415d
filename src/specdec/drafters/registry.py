"""The method registry: every drafting method is a name, a frozen options class and a builder.

`api.load`, the CLI (`--method` and its option flags), `bench` method specs (`eagle2:depth=3:topk=4`),
the README's method table and `auto` all read it, so a new method is one file that calls `register`
plus one line in BUILTIN. Options are parsed here, before any model loads: an unknown name or a bad
value is one SpecdecError naming the method, the option and what it accepts.

One name per quantity, everywhere (API keyword, CLI flag, bench spec, docs):
  depth      draft steps from the root (tree depth)
  topk       children per expanded node
  tree_size  nodes kept in a draft tree
  chain_len  tokens in a draft chain
  lookup     tokens of a prompt-lookup chain joined to a model's tree
On the command line `topk` is `--tree-topk`, apart from sampling's `--top-k` (FLAG_NAMES).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecdecError
from specdec.options import Options, Param, bool_flag, flag_help, option

if TYPE_CHECKING:  # loading imports torch: `specdec methods` and option errors must stay fast
    from specdec.runtime.loading import Runtime

__all__ = ["Method", "Options", "Target", "get", "markdown_table", "methods", "names", "option", "parse", "register"]

# modules whose import registers the built-in methods, in the order the docs list them
BUILTIN = ("specdec.drafters.vanilla", "specdec.drafters.draft_model", "specdec.drafters.prompt_lookup",
           "specdec.drafters.ngram", "specdec.drafters.lookahead", "specdec.drafters.eagle", "specdec.drafters.fspad",
           "specdec.drafters.eagle3", "specdec.drafters.medusa", "specdec.drafters.hydra", "specdec.drafters.auto")

_METHODS: dict[str, Method] = {}


class NoOptions(Options):
    pass


@dataclass
class Target:
    """What a builder may use: the target model and its runner, the draft model for SpS, and how the
    models run (checked once, before the target's runner was built; None: the defaults)."""

    model: Any
    runner: Any
    tokenizer: Any = None
    draft_model: Any = None
    draft_tokenizer: Any = None
    runtime: Runtime | None = None


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line for --help and the README table
    options: type[Options]
    build: Callable[[Target, Any], Any]  # (target, options) -> Drafter
    needs_draft: bool = False  # must have a draft model (draft=)
    takes_draft: bool = False  # uses a draft model when one is given


def register(method: Method) -> Method:
    if method.name in _METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    _METHODS[method.name] = method
    return method


def methods() -> dict[str, Method]:
    for mod in BUILTIN:  # a no-op once imported; a drafter module imported directly registers only itself
        importlib.import_module(mod)
    # BUILTIN's order, whatever order the modules were first imported in; then any others as registered
    rank = {mod: i for i, mod in enumerate(BUILTIN)}
    order = sorted(_METHODS.values(), key=lambda m: rank.get(m.build.__module__, len(rank)))
    return {m.name: m for m in order}


def names() -> tuple[str, ...]:
    return tuple(methods())


def get(name: str) -> Method:
    found = methods().get(name)
    if found is None:
        raise SpecdecError(f"unknown method {name!r}; choose one of: {', '.join(names())}")
    return found


def parse(name: str, raw: Mapping[str, Any] | None = None) -> tuple[Method, Options]:
    """Validate a method and its options without loading anything."""
    m = get(name)
    return m, m.options.parse(raw, where=f"method {name!r}")


def option_params() -> dict[str, tuple[Param, bool]]:
    """Every option name and alias of every method -> (its declaration, whether it is an alias); the
    first declaration wins. The CLI makes one flag of each."""
    out: dict[str, tuple[Param, bool]] = {}
    for m in methods().values():
        for p in m.options.params():
            out.setdefault(p.name, (p, False))
            for a in p.aliases:
                out.setdefault(a, (p, True))
    return out


# command-line spellings that differ from the option name; the option name stays a hidden, deprecated flag
FLAG_NAMES = {"topk": "tree-topk"}


class _Deprecated(argparse.Action):
    """A flag's old spelling: still works, with a one-line note on stderr."""

    def __init__(self, *args, new: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"specdec: note: {option_string} is deprecated, use {self.new} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per method option (dest `opt_<name>`; values stay text for the method's options class
    to check), with every method's default for it, and the old spellings of renamed flags hidden."""
    defaults: dict[str, dict[str, list[str]]] = {}
    for m in methods().values():
        for p in m.options.params():
            defaults.setdefault(p.name, {}).setdefault(p.shown, []).append(m.name)
    for key, (par, alias) in option_params().items():
        name = FLAG_NAMES.get(key, key.replace("_", "-"))
        kw = dict(dest=f"opt_{key}", default=None, metavar=par.metavar)
        if par.boolean:
            kw |= bool_flag()
        if alias:
            parser.add_argument("--" + name, help=argparse.SUPPRESS, **kw)
            continue
        by_method = defaults[key]
        shown = next(iter(by_method)) if len(by_method) == 1 else \
            "; ".join(f"{v} for {', '.join(ms)}" for v, ms in by_method.items())
        parser.add_argument("--" + name, help=flag_help(par, shown), **kw)
        if key in FLAG_NAMES:
            old = "--" + key.replace("_", "-")
            parser.add_argument(old, help=argparse.SUPPRESS, action=_Deprecated, new="--" + name,
                                **{k: v for k, v in kw.items() if k != "action"})


def markdown_table() -> str:
    """The README's method table, generated so it cannot drift from the code."""
    rows = ["| method | what drafts | options (default) |", "|---|---|---|"]
    for m in methods().values():
        opts = ", ".join(f"`{p.name}` ({p.shown})" for p in m.options.params())
        rows.append(f"| `{m.name}` | {m.summary} | {opts} |")
    return "\n".join(rows) + "\n"
