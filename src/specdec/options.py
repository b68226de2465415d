"""Typed parameters, each declared once with its type and range.

Every method option (drafters/registry.py), the sampling fields (sampling.py), the generation limits,
the runtime settings (api.py) and the training settings (training/config.py) are fields of an `Options`
model. The CLI's flags, the API's keywords, bench specs and (later) the server's request fields are all
checked by these models before any model loads, and a bad value is one `SpecdecError` naming the
parameter, the value and what is allowed. Python callers are checked strictly (a str is not an int,
True is not 1); text from a command line or a spec is converted first ("5" -> 5, "true" -> True,
"[[0],[1]]" -> a list).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo

from specdec.errors import SpecdecError


def option(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, aliases: tuple[str, ...] = (), shown: str | None = None,
           metavar: str | None = None, escapes: bool = False) -> Any:
    """A field: its default (`shown` describes a None default in docs), one line of help, its range,
    older names it still accepts, the flag's metavar (default: from the type: N, X, TEXT, {a,b}) and
    whether a command line's backslash escapes (\\n, \\t, \\uXXXX) are interpreted."""
    return Field(default, description=help, ge=ge, gt=gt, le=le,
                 json_schema_extra={"aliases": list(aliases), "shown": shown, "metavar": metavar,
                                    "escapes": escapes})


@dataclass(frozen=True)
class Param:
    """One declared field, as the CLI, the docs and error messages need it."""

    name: str
    default: Any
    help: str
    aliases: tuple[str, ...]
    shown: str  # the default as docs show it
    allowed: str  # "an integer >= 1", "one of value, confidence", ...
    metavar: str = "X"  # N, X, TEXT, PATH, {a,b}, ...
    boolean: bool = False
    escapes: bool = False  # a command line's backslash escapes are interpreted
    required: bool = False  # no default: the flag must be given


class Options(BaseModel):
    """Base of every parameter set. Subclasses declare fields with `option(...)`; an instance is valid."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _paths_are_text(cls, data: Any) -> Any:  # a pathlib.Path is as good as a str for a path option
        if isinstance(data, dict):
            return {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in data.items()}
        return data

    def __init__(self, **kw: Any) -> None:
        try:
            super().__init__(**kw)
        except ValidationError as e:
            raise SpecdecError(_one_line(type(self), e, kw)) from None

    @classmethod
    def label(cls, name: str) -> str:
        """How errors name a field (a parameter set named by its flags says "--max-len")."""
        return name

    @classmethod
    def params(cls) -> tuple[Param, ...]:
        return tuple(_param(name, f) for name, f in cls.model_fields.items())

    @classmethod
    def aliases(cls) -> dict[str, str]:
        return {a: p.name for p in cls.params() for a in p.aliases}

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None = None, where: str = "") -> typing.Self:
        """A valid instance from keywords; str values of non-str fields are text to convert.
        `where` names the parameter set in errors, e.g. "method 'eagle2'"."""
        where = f"{where}: " if where else ""
        names, alias = set(cls.model_fields), cls.aliases()
        kw: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        for key, value in (raw or {}).items():
            name = alias.get(key, key)
            if name not in names:
                valid = ", ".join(sorted(names)) or "none"
                raise SpecdecError(f"{where}unknown option {key!r} (valid: {valid})")
            if name in kw:
                raise SpecdecError(f"{where}{name!r} given twice (once as {key!r})")
            kw[name] = value
            given_as[name] = key
        for name, value in kw.items():
            f = cls.model_fields[name]
            if isinstance(value, str) and _base(f.annotation) is not str:
                try:
                    kw[name] = _from_text(f.annotation, value)
                except ValidationError:
                    shown = cls.label(name) + ("" if given_as[name] == name else f" (given as {given_as[name]!r})")
                    raise SpecdecError(f"{where}{shown} must be {_allowed(f)}, got {value!r}") from None
        try:
            return cls(**kw)
        except SpecdecError as e:
            msg = str(e)
            for name, key in given_as.items():  # name the option as the user wrote it
                label = cls.label(name)
                if key != name and msg.startswith(label + " "):
                    msg = f"{label} (given as {key!r}){msg[len(label):]}"
            raise SpecdecError(f"{where}{msg}") from None


def add_flags(parser: argparse.ArgumentParser, schema: type[Options], only: tuple[str, ...] | None = None,
              skip: tuple[str, ...] = (), early: bool = False) -> None:
    """One command-line flag per declared field (a list field: a repeatable flag; a bool: `--flag` alone
    means true, `--flag false` still works; a field without a default: a required flag). Values stay text
    until `schema.parse(flag_values(args, schema))`, so a command accepts exactly what the API does and
    reports errors the same way. early: each value is also checked against its field as argparse reads
    it (a bad one exits 2 with argparse's one line, before the command runs)."""
    for par in schema.params():
        if (only is not None and par.name not in only) or par.name in skip:
            continue
        many = isinstance(par.default, list)
        kw: dict[str, Any] = dict(dest=f"{schema.__name__}.{par.name}", metavar=par.metavar,
                                  default=[] if many else None, help=flag_help(par), required=par.required)
        if par.boolean:
            kw |= bool_flag()
        else:
            kw["action"] = "append" if many else "store"
            if par.escapes:
                kw["type"] = unescape
            elif early:
                kw["type"] = field_type(schema.model_fields[par.name])
        parser.add_argument("--" + par.name.replace("_", "-"), **kw)


def field_type(f: FieldInfo) -> Callable[[str], Any]:
    """An argparse `type=` checking a value against one declared field (its type and range)."""
    ann = Annotated[(f.annotation, *f.metadata)] if f.metadata else f.annotation
    adapter = TypeAdapter(ann, config=ConfigDict(allow_inf_nan=False))

    def parse(text: str) -> Any:
        try:
            return _from_text(f.annotation, text, adapter)
        except ValidationError:
            raise argparse.ArgumentTypeError(f"must be {_allowed(f)}, got {text!r}") from None
    return parse


def flag_help(par: Param, default: str | None = None) -> str:
    """The help line with its default said once: a help text that already names its default keeps it."""
    text = par.help + (" (backslash escapes such as \\n and \\t are interpreted)" if par.escapes else "")
    if par.required:
        return text
    shown = par.shown if default is None else default
    return text if "default" in par.help.lower() else f"{text} (default {shown})"


TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
BOOL_WORDS = TRUE_WORDS + FALSE_WORDS


class _BoolValue(argparse.Action):
    """`--flag` alone is true; `--flag true|false` as before. Another word after the flag is an error
    that says what the flag takes (a prompt after a bare switch would otherwise be read as its value).
    A bool const stores a bool; a text const ("true") keeps the word for an Options model to convert."""

    def __call__(self, parser, namespace, values, option_string=None):
        word = None if values is None else str(values).strip().lower()
        if word is not None and word not in BOOL_WORDS:
            raise argparse.ArgumentError(self, f"takes true or false, or nothing (= true), got {values!r}; "
                                         "a prompt goes before the flags")
        if word is None:
            value = self.const
        else:
            value = word in TRUE_WORDS if isinstance(self.const, bool) else values
        setattr(namespace, self.dest, value)


def bool_flag(const: Any = "true") -> dict[str, Any]:
    """argparse keywords of a boolean flag: `--flag`, `--flag true`, `--flag false`."""
    return dict(nargs="?", const=const, action=_BoolValue)


def unescape(text: str) -> str:
    """A command line's backslash escapes as Python reads them: "\\n" -> a newline, "\\t", "\\u00e9"...;
    other characters, non-ASCII ones included, stay as typed."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"has a broken backslash escape ({e.reason}): {text!r}") from None


def flag_values(args: argparse.Namespace, schema: type[Options]) -> dict[str, Any]:
    """The flags of `schema` that were given (as text)."""
    prefix = schema.__name__ + "."
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix) and v not in (None, [])}


def arg_type(kind: type, *, ge: float | None = None, gt: float | None = None,
             le: float | None = None) -> Callable[[str], Any]:
    """An argparse `type=` for a flag only one tool has (bench's --repeats, datagen's --shards): the same
    conversion, range check and wording as a declared field, as argparse's one-line error."""
    ann = Annotated[kind, Field(ge=ge, gt=gt, le=le, allow_inf_nan=False)]
    adapter, info = TypeAdapter(ann), FieldInfo.from_annotation(ann)

    def parse(text: str) -> Any:
        try:
            return adapter.validate_python(str(text).strip(), strict=False)
        except ValidationError:
            raise argparse.ArgumentTypeError(f"must be {_allowed(info)}, got {text!r}") from None
    return parse


def checked(name: str, value, rule: Callable[[str], Any]):
    """`rule` (an arg_type) applied to an API value: a SpecdecError naming the CLI flag."""
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    try:
        return rule(text)
    except argparse.ArgumentTypeError as e:
        raise SpecdecError(f"--{name.replace('_', '-')} {e}") from None


@functools.cache
def _adapter(ann: Any) -> TypeAdapter:
    return TypeAdapter(ann)


def _from_text(ann: Any, text: str, adapter: TypeAdapter | None = None) -> Any:
    text = text.strip()
    adapter = adapter or _adapter(ann)
    if text.lower() in ("none", "null") and type(None) in typing.get_args(ann):
        return None
    if _base(ann) in (list, tuple):
        return adapter.validate_json(text)
    return adapter.validate_python(text, strict=False)


def _base(ann: Any) -> Any:
    """int for `int | None`, list for `list[list[int]]`, Literal for a Literal, str for Annotated[str, ...]."""
    ann = _base_ann(ann)
    return typing.get_origin(ann) or ann


def _base_ann(ann: Any) -> Any:
    """The annotation without None and Annotated: list[str] for `list[str] | None`."""
    if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:
        return _base_ann(next(a for a in typing.get_args(ann) if a is not type(None)))
    if typing.get_origin(ann) is Annotated:
        return _base_ann(typing.get_args(ann)[0])
    return ann


def _allowed(f: FieldInfo) -> str:
    ann = f.annotation
    base = _base(ann)
    if base is typing.Literal:
        lit = ann if typing.get_origin(ann) is typing.Literal else \
            next(a for a in typing.get_args(ann) if typing.get_origin(a) is typing.Literal)
        return "one of " + ", ".join(map(str, typing.get_args(lit)))
    what = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(base)
    if what is None:
        what = "a list (JSON as text)" if base in (list, tuple) else f"a {getattr(base, '__name__', base)}"
    ops = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    bounds = [f"{op} {getattr(m, a)}" for m in f.metadata for a, op in ops if getattr(m, a, None) is not None]
    if bounds:
        what += " " + " and ".join(bounds)
    if type(None) in typing.get_args(ann):
        what += " (or none)"
    return what


def _param(name: str, f: FieldInfo) -> Param:
    extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
    required = f.is_required()
    default = None if required else f.get_default(call_default_factory=True)
    shown = extra.get("shown") or (json.dumps(default) if isinstance(default, (list, tuple, bool)) or default is None
                                   else str(default))
    return Param(name, default, f.description or "", tuple(extra.get("aliases") or ()), shown, _allowed(f),
                 extra.get("metavar") or _metavar(f.annotation), _base(f.annotation) is bool,
                 bool(extra.get("escapes")), required)


def _metavar(ann: Any) -> str:
    base = _base(ann)
    if base is typing.Literal:
        lit = ann if typing.get_origin(ann) is typing.Literal else \
            next(a for a in typing.get_args(ann) if typing.get_origin(a) is typing.Literal)
        return "{" + ",".join(map(str, typing.get_args(lit))) + "}"
    if base in (list, tuple):  # a repeatable flag of strings, or a JSON list
        inner = typing.get_args(_base_ann(ann))
        return "TEXT" if inner and _base(inner[0]) is str else "JSON"
    return {int: "N", float: "X", bool: "{true,false}", str: "TEXT"}.get(base, "X")


def _one_line(cls: type[Options], err: ValidationError, given: Mapping[str, Any]) -> str:
    """The first error as "<name> must be <allowed>, got <value>" (or a validator's own words)."""
    e = err.errors()[0]
    loc = [str(x) for x in e.get("loc", ())]
    name = loc[0] if loc else "?"
    value = given.get(name, e.get("input"))
    if e.get("type") == "extra_forbidden":
        return f"unknown option {name!r} (valid: {', '.join(cls.model_fields) or 'none'})"
    if e.get("type") == "missing":
        return f"{cls.label(name)} must be given"
    if e.get("type") == "value_error":  # a field validator says "must be ..., got ..." itself
        said = e.get("ctx", {}).get("error", e["msg"])
        return f"{cls.label(name)} {said}" if loc else str(said)  # a model validator names its fields itself
    f = cls.model_fields.get(name)
    allowed = _allowed(f) if f is not None else e["msg"].removeprefix("Input ").removeprefix("should be ")
    return f"{cls.label(name)} must be {allowed}, got {value!r}"


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Bad arguments print one line like every other specdec error (exit 2), not a usage block."""
    p.error = lambda message: p.exit(2, f"specdec: error: {message} (see `{p.prog} -h`)\n")
    return p
