"""Where `specdec tune`'s choice for a head lives: `tuning.json` next to the head, or under the cache for
a head that ships inside the package (or sits in a read-only dir). Drafters read it through here;
only the `tune` tool writes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.files import atomic_write_text, cache_dir

PACKAGE_DIR = Path(__file__).resolve().parent
BUDGET_KEYS = ("depth", "topk", "tree_size")
_LEGACY = {"total_tokens": "tree_size"}  # files written before the names were unified


def tuning_path(head_dir: str | os.PathLike) -> Path:
    """Where `specdec tune` writes by default: next to the head, unless the head ships inside the
    package or its dir is read-only; then under the cache (SPECDEC_CACHE or ~/.cache/specdec)."""
    head_dir = Path(head_dir).resolve()
    if head_dir.is_relative_to(PACKAGE_DIR) or not os.access(head_dir, os.W_OK):
        return cache_dir() / "tuning" / f"{head_dir.name}.json"
    return head_dir / "tuning.json"


def _read(head_dir: str | os.PathLike, parse):
    """parse(raw json) of the first tuning file found for this head (this machine's, then the shipped
    one), or None; a file that does not parse is one clear error, never a silent default."""
    for f in dict.fromkeys([tuning_path(head_dir), Path(head_dir).resolve() / "tuning.json"]):
        if not f.is_file():
            continue
        try:
            return parse(json.loads(f.read_text()), f)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if isinstance(e, SpecdecError):
                raise
            raise SpecdecError(f"{f} is not a valid tuning file ({type(e).__name__}: {e}): "
                               "re-run `specdec tune` or delete it") from None
    return None


def load_tuning(head_dir: str | os.PathLike, auto: bool = False, sampled: bool = False) -> dict | None:
    """{depth, topk, tree_size} for this head: this machine's own `specdec tune` result if there is
    one, else the tuning.json shipped next to the head, else None. auto: the choice for `auto`, which
    adds `lookup` (0 in files written before tune measured lookup chains). sampled: the choice for
    sampled requests with sampled children (`sampled`), None in files written before tune made one."""
    def parse(raw: dict, f: Path) -> dict | None:
        if sampled and "sampled" not in raw:
            return None
        src = raw["sampled"] if sampled else raw["auto"] if auto and "auto" in raw else raw
        src = {_LEGACY.get(k, k): v for k, v in src.items()}
        vals = {k: src[k] for k in BUDGET_KEYS}
        if not all(type(v) is int and v >= 1 for v in vals.values()):
            raise SpecdecError(f"{f}: depth, topk and tree_size must be integers >= 1, got {vals}")
        if auto:
            lookup = src.get("lookup", 0)
            if type(lookup) is not int or lookup < 0:
                raise SpecdecError(f"{f}: lookup must be an integer >= 0, got {lookup!r}")
            vals["lookup"] = lookup
        return vals
    return _read(head_dir, parse)


def load_acceptance(head_dir: str | os.PathLike, sampled: bool = False) -> list[dict]:
    """The acceptance table tune measured for this head (greedy tau per budget: machine-independent),
    from the same file load_tuning reads; older files have only their fastest rows (`top`). [] if none.
    sampled: the T = 1 table of trees with sampled children (`acceptance_sampled`), [] if not measured."""
    def parse(raw: dict, f: Path) -> list[dict]:
        rows = raw.get("acceptance_sampled", []) if sampled else raw.get("acceptance") or raw.get("top") or []
        out = [{k: r[k] for k in (*BUDGET_KEYS, "tau")} for r in rows]
        if not all(type(r[k]) is int and r[k] >= 1 for r in out for k in BUDGET_KEYS) or \
                not all(isinstance(r["tau"], (int, float)) and r["tau"] >= 1 for r in out):
            raise SpecdecError(f"{f}: acceptance rows need integer depth, topk, tree_size >= 1 and tau >= 1")
        return out
    return _read(head_dir, parse) or []


def load_lookup_rates(head_dir: str | os.PathLike, buckets: int, drafter: str) -> dict[str, list[float | None]] | None:
    """{"greedy": [...], "sampled": [...]} (either may be absent): the accepted share of `auto`'s n-gram
    nodes per calibration bucket that tune measured (`lookup_rates`, None where too few), or None if the
    file has none, or measured them over another number of buckets or with another n-gram drafter than
    `drafter` (drafters.auto.ngram_key; a file that names none measured the lookup chain `auto` drafts
    with it, 12 tokens where its tuning found none paying)."""
    def parse(raw: dict, f: Path) -> dict | None:
        rates = raw.get("lookup_rates")
        if rates is None:
            return None
        if not isinstance(rates, dict) or not all(
                k == "drafter" and isinstance(v, str) or k in ("greedy", "sampled") and isinstance(v, list) and
                all(r is None or (isinstance(r, (int, float)) and 0 <= r <= 1) for r in v) for k, v in rates.items()):
            raise SpecdecError(f"{f}: lookup_rates must map greedy / sampled to lists of shares in [0, 1] or null")
        measured = rates.get("drafter") or f"pld:{(raw.get('auto') or {}).get('lookup') or 12}"
        if measured != drafter:
            return None
        return {k: v for k, v in rates.items() if k != "drafter" and len(v) == buckets} or None
    return _read(head_dir, parse)


def save_tuning(record: dict, path: str | os.PathLike) -> Path:
    return atomic_write_text(path, json.dumps(record, indent=1) + "\n")
