"""Files: atomic writes (a reader or a killed writer never sees half a file or directory) and where the
project's question sets and caches live. Every module that writes or looks for data uses these."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError


def _umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _normal_modes(root: Path) -> None:
    """mkstemp/mkdtemp (and some writers, e.g. safetensors) make 0600/0700: give a finished temporary
    file or tree the modes an ordinary open() would have, so atomic writes honour the umask."""
    u = _umask()
    for p in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if p.is_symlink():
            continue
        execable = p.is_dir() or p.stat().st_mode & 0o100
        p.chmod((0o777 if execable else 0o666) & ~u)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yields a temporary path next to `path`; on success it replaces `path` in one rename. mode: None =
    what the umask gives a new file (0644 under umask 022)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        if mode is None:
            _normal_modes(Path(tmp))
        else:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty temporary directory next to `path`; on success it takes `path`'s place (an
    existing directory there is replaced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        _normal_modes(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_writable(out_dir: str | os.PathLike, flag: str = "--out") -> None:
    """A SpecdecError naming `flag` unless a file can be written in `out_dir`; tried for real (permissions
    alone miss /proc, read-only mounts and root), and whatever the try created is removed again."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"{flag} {out_dir} is a file, not a directory")
    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise SpecdecError(f"{flag} {out_dir} is not a writable directory ({e.strerror or e})") from None
    finally:
        for p in made:  # the innermost first
            try:
                p.rmdir()
            except OSError:
                break


def cache_dir() -> Path:
    """Where converted models, measured costs and built kernels are kept (SPECDEC_CACHE overrides)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def packaged_data_dir() -> Path:
    """The question sets shipped inside the package (Spec-Bench, GSM8K; see data/README.md). Wheels install
    unpacked, so this is a real directory."""
    return Path(str(resources.files("specdec") / "data"))


def data_roots() -> list[Path]:
    """Where the question sets (Spec-Bench, MT-bench, GSM8K) are looked for: $SPECDEC_DATA (same layout),
    then the package's own copy."""
    roots = [Path(os.environ["SPECDEC_DATA"])] if os.environ.get("SPECDEC_DATA") else []
    return list(dict.fromkeys([*roots, packaged_data_dir()]))


def find_data(rel: str) -> Path | None:
    """The first data root holding `rel` (e.g. "gsm8k/train.jsonl"), or None."""
    return next((root / rel for root in data_roots() if (root / rel).exists()), None)


def read_json_object(f: Path, what: str) -> dict:
    """A JSON object file (a head's config.json), or a SpecdecError naming `what` and the fault."""
    try:
        raw = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{what}: {f.name} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SpecdecError(f"{what}: {f.name} must hold a JSON object")
    return raw
