"""The bench's results directory: writable, and empty unless an earlier run's results may be replaced."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from specdec.errors import SpecdecError


def ensure_writable_dir(d: Path, what: str) -> None:
    """Creates d if needed and proves a file can be written in it; else one SpecdecError naming `what`."""
    if d.exists() and not d.is_dir():
        raise SpecdecError(f"{what}: {d} exists and is not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise SpecdecError(f"{what}: cannot write to {d} ({e.strerror or e})") from None


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Before anything slow: the results dir must be writable, and empty unless overwrite is given.
    Nothing is deleted here (see clear_out_dir); --overwrite only replaces an earlier run's results, so
    a mistyped `--out .` or `--out ~` cannot wipe a directory that holds anything else."""
    ensure_writable_dir(out, "--out")
    try:
        if not any(out.iterdir()):
            return
    except OSError as e:
        raise SpecdecError(f"--out: cannot list {out} ({e.strerror or e})") from None
    if not overwrite:
        raise SpecdecError(f"--out {out} is not empty (an earlier run's files would mix with this run's): "
                           "pass --overwrite to replace them, or choose another directory")
    if not ((out / "run.json").is_file() or (out / "raw").is_dir()):
        raise SpecdecError(f"--out {out} is not empty and holds no `specdec bench` results (no run.json or raw/): "
                           "--overwrite only replaces an earlier run's results; choose another directory")


def clear_out_dir(out: Path) -> None:
    for p in out.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def report_dest(out: str | None) -> Path | None:
    """A Markdown report's --out file, checked before the work: not a directory, in a writable one."""
    dest = Path(out) if out else None
    if dest is not None:
        if dest.is_dir():
            raise SpecdecError(f"--out {dest} is a directory: give a file name")
        ensure_writable_dir(dest.parent, f"--out {dest}")
    return dest


def write_report(md: str, dest: Path | None) -> None:
    """The report on stdout, and into --out when given."""
    import sys

    sys.stdout.write(md)
    if dest is not None:
        try:
            dest.write_text(md)
        except OSError as e:
            raise SpecdecError(f"--out {dest}: cannot write ({e.strerror or e})") from None
