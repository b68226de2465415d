"""`specdec bench compare A B`: two results dirs side by side (speedup, τ, tokens/s per method × category)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from specdec.bench.metrics import OVERALL
from specdec.errors import SpecdecError


def load_result(d: str | Path) -> tuple[dict, dict, dict]:
    d = Path(d)
    if not d.is_dir():
        raise SpecdecError(f"{str(d)!r} is not a directory")
    out = []
    for name in ("run.json", "summary.json", "audit.json"):
        p = d / name
        if not p.is_file():
            raise SpecdecError(f"{d} is not a `specdec bench` results directory (no {name})")
        try:
            out.append(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{p}: not valid JSON ({e.msg})") from None
    return tuple(out)


def _f(x, nd=2, suffix="") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}{suffix}"


def _delta(a, b) -> str:
    if a is None or b is None or not a or any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return "—"
    return f"{100 * (b - a) / a:+.0f}%"


def _other_load(run: dict) -> str:
    x = (run.get("contention") or {}).get("other_cpu_frac")
    return _f(None if x is None else 100 * x, 1, "%")


def compare(a: str | Path, b: str | Path) -> str:
    ra, sa, aa = load_result(a)
    rb, sb, ab = load_result(b)
    setup = []
    for label, get in [
        ("target", lambda r: r["config"].get("extra", {}).get("model") or r["target"].get("name_or_path")),
        ("baseline", lambda r: r["baseline"]),
        ("questions", lambda r: r["questions"]), ("categories", lambda r: ", ".join(r["categories"])),
        ("max_new_tokens", lambda r: r["config"]["max_new_tokens"]),
        ("temperature", lambda r: r["config"]["temperature"]), ("repeats", lambda r: r["config"]["repeats"]),
        ("CPU", lambda r: r["machine"]["cpu"]), ("torch threads", lambda r: r["machine"]["torch_threads"]),
        ("torch", lambda r: r["machine"]["torch"]), ("transformers", lambda r: r["machine"]["transformers"]),
        ("commit", lambda r: r["machine"].get("git_commit", "")),
        ("other CPU load", _other_load), ("started", lambda r: r["started"]),
    ]:
        va, vb = get(ra), get(rb)
        setup.append(f"| {label} | {va} | {vb} |{' ≠' if va != vb else ''}")
    md = ["# specdec bench compare", "", f"A = `{a}`  ", f"B = `{b}`", "",
          "| | A | B |", "|---|---|---|", *setup, "",
          f"Audit: A {'PASS' if aa['ok'] else 'FAIL'} ({aa['bugs']} bugs, {aa['ties']} ties), "
          f"B {'PASS' if ab['ok'] else 'FAIL'} ({ab['bugs']} bugs, {ab['ties']} ties).", ""]
    methods = list(dict.fromkeys([*sa, *sb]))
    cats = list(dict.fromkeys([OVERALL, *ra["categories"], *rb["categories"]]))
    md += ["Speedup is against each run's own baseline; τ = tokens per target forward, decode phase, prefill "
           "excluded; Δ = (B − A) / A.", "",
           "| method | category | speedup A | speedup B | Δ | τ A | τ B | tok/s A | tok/s B | Δ tok/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for c in cats:
            ca, cb = sa.get(m, {}).get(c), sb.get(m, {}).get(c)
            if ca is None and cb is None:
                continue
            g = lambda cell, k: None if cell is None else cell.get(k)  # noqa: E731
            name = f"**{c}**" if c == OVERALL else c
            md.append(
                f"| `{m}` | {name} | {_f(g(ca, 'speedup'), 2, '×')} | {_f(g(cb, 'speedup'), 2, '×')} | "
                f"{_delta(g(ca, 'speedup'), g(cb, 'speedup'))} | {_f(g(ca, 'tau'))} | {_f(g(cb, 'tau'))} | "
                f"{_f(g(ca, 'tokens_per_s'), 1)} | {_f(g(cb, 'tokens_per_s'), 1)} | "
                f"{_delta(g(ca, 'tokens_per_s'), g(cb, 'tokens_per_s'))} |")
    return "\n".join(md) + "\n"
