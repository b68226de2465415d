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
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import SpecdecError

# modules whose import registers the built-in methods, in the order the docs list them
BUILTIN = ("specdec.drafters.vanilla", "specdec.drafters.draft_model", "specdec.drafters.prompt_lookup",
           "specdec.drafters.eagle", "specdec.drafters.auto")

_METHODS: dict[str, Method] = {}


def option(default: Any, help: str, *, min: float | None = None, choices: tuple = (),
           aliases: tuple[str, ...] = (), shown: str | None = None) -> Any:
    """A field of an options class: its default (`shown` describes a None default), a one-line help,
    and what values it accepts."""
    return field(default=default, metadata={"help": help, "min": min, "choices": choices, "aliases": aliases,
                                            "shown": shown})


class Options:
    """Base of every method's frozen options dataclass. Fields are declared with `option(...)`."""

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def aliases(cls) -> dict[str, str]:
        return {a: f.name for f in cls.fields() for a in f.metadata.get("aliases", ())}

    @classmethod
    def parse(cls, method: str, raw: Mapping[str, Any]) -> Options:
        """Typed, range-checked options from keywords or strings (CLI and bench give strings)."""
        names = {f.name for f in cls.fields()}
        alias = cls.aliases()
        kw: dict[str, Any] = {}
        for key, value in raw.items():
            name = alias.get(key, key)
            if name not in names:
                valid = ", ".join(sorted(names)) or "none"
                raise SpecdecError(f"unknown option {key!r} for method {method!r} (its options: {valid})")
            if name in kw:
                raise SpecdecError(f"option {name!r} given twice for method {method!r} (once as {key!r})")
            kw[name] = value
        hints = typing.get_type_hints(cls)
        for f in cls.fields():
            if f.name in kw:
                kw[f.name] = _convert(method, f, hints[f.name], kw[f.name])
        return cls(**kw)


@dataclass(frozen=True)
class NoOptions(Options):
    pass


@dataclass
class Target:
    """What a builder may use: the target model and its runner, and the draft model for SpS."""

    model: Any
    runner: Any
    tokenizer: Any = None
    draft_model: Any = None
    draft_tokenizer: Any = None
    backend: str = "auto"


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line for --help and the README table
    options: type[Options]
    build: Callable[[Target, Any], Any]  # (target, options) -> Drafter
    needs_draft: bool = False


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
    return m, m.options.parse(name, dict(raw or {}))


def option_names() -> dict[str, dataclasses.Field]:
    """Every option name any method takes (first declaration wins), for the CLI's flags."""
    out: dict[str, dataclasses.Field] = {}
    for m in methods().values():
        for f in m.options.fields():
            out.setdefault(f.name, f)
    return out


def markdown_table() -> str:
    """The README's method table, generated so it cannot drift from the code."""
    rows = ["| method | what drafts | options (default) |", "|---|---|---|"]
    for m in methods().values():
        opts = ", ".join(f"`{f.name}` ({f.metadata.get('shown') or _show(f.default)})" for f in m.options.fields())
        rows.append(f"| `{m.name}` | {m.summary} | {opts} |")
    return "\n".join(rows) + "\n"


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, tuple, bool)) or v is None else str(v)


def _describe(f: dataclasses.Field, typ: Any) -> str:
    base = _base_type(typ)
    what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(base, "a JSON list")
    lo, choices = f.metadata.get("min"), f.metadata.get("choices")
    if choices:
        what = "one of " + ", ".join(map(str, choices))
    elif lo is not None:
        what += f" >= {lo:g}"
    return what


def _base_type(typ: Any) -> Any:
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        return _base_type(args[0])
    return typing.get_origin(typ) or typ


def _convert(method: str, f: dataclasses.Field, typ: Any, value: Any) -> Any:
    base = _base_type(typ)
    optional = type(None) in typing.get_args(typ)

    def bad() -> SpecdecError:
        return SpecdecError(f"method {method!r}: option {f.name} must be {_describe(f, typ)}, got {value!r}")

    if value is None:
        if optional:
            return None
        raise bad()
    v = os.fspath(value) if base is str and isinstance(value, os.PathLike) else value
    if isinstance(v, str) and base is not str:
        text = v.strip()
        try:
            if base is bool:
                v = {"true": True, "false": False, "1": True, "0": False}[text.lower()]
            elif base in (int, float):
                v = base(text)
            else:
                v = json.loads(text)
        except (KeyError, ValueError):
            raise bad() from None
    if base is bool and not isinstance(v, bool):
        raise bad()
    if base is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise bad()
    if base is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise bad()
    if base is str and not isinstance(v, str):
        raise bad()
    if base in (list, tuple) and not isinstance(v, (list, tuple)):
        raise bad()
    lo, choices = f.metadata.get("min"), f.metadata.get("choices")
    if (choices and v not in choices) or (lo is not None and v < lo):
        raise bad()
    return float(v) if base is float else v
