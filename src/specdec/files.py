"""Files: atomic writes (a reader or a killed writer never sees half a file or directory) and where the
project's shared data lives. Every module that writes or looks for data uses these."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """Yields a temporary path next to `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, mode)  # mkstemp makes 0600
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
    tmp.chmod(0o755)  # mkdtemp makes 0700
    try:
        yield tmp
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


def data_roots() -> list[Path]:
    """Where the shared data (Spec-Bench, MT-bench, GSM8K) may live: $SPECDEC_DATA, then ./shared/data,
    ../shared/data and the checkout's sibling shared/data. The repo never copies these files."""
    roots = [Path(os.environ["SPECDEC_DATA"])] if os.environ.get("SPECDEC_DATA") else []
    repo = Path(__file__).resolve().parents[2]
    roots += [Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data", repo.parent / "shared" / "data"]
    return list(dict.fromkeys(roots))


def shared_data_dir() -> Path:
    """The first data root that exists (else the checkout's sibling shared/data, for messages)."""
    roots = data_roots()
    return next((r for r in roots if r.is_dir()), roots[-1])


def find_data(rel: str) -> Path | None:
    """The first data root holding `rel` (e.g. "gsm8k/train.jsonl"), or None."""
    return next((root / rel for root in data_roots() if (root / rel).exists()), None)
