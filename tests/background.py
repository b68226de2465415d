"""Work the suite needs later, started as the session begins in niced background processes when pytest runs
one test at a time (`make test` runs two xdist workers, and then nothing starts here): such a run leaves the
second core mostly idle, so a minute of compiling or converting there costs the wall clock nothing, where the
first test needing it would wait for all of it.

- `avx2`: the kernels built for AVX2 alone, which test_gguf compares bit for bit with the AVX-512 build
  (once per version of the sources, into the suite's kernel cache; a minute or two).
- `smollm2-fp32`: the embedded SmolLM2 converted to an HF directory in fp32 (this session's cache), for the
  tests that run transformers' own generate beside ours.

A test waits for its job (`wait`) and then does the work itself where it is still missing, so a failed or
unfinished job only costs time, and its error shows in the test."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from specdec.files import cache_dir
from specdec.runtime import kernel_build, stream

_jobs: dict[str, subprocess.Popen] = {}
REPO = Path(__file__).resolve().parents[1]


def avx2_so() -> tuple[str, Path]:
    key = kernel_build.build_key(kernel_build.FLAGS)
    name = f"specdec_stream_avx2_test_{key}"
    return name, cache_dir() / "kernels" / f"avx2-test-{key}" / f"{name}.so"


def avx2_kernels():
    """The AVX2 module: built by its job, else here."""
    wait("avx2")
    name, so = avx2_so()
    return stream._import(name, so) if so.exists() else stream._build(name, kernel_build.FLAGS, so.parent)


# job -> (the test modules that need it, whether it is still to do, the code that does it)
JOBS = {
    "avx2": ("test_gguf", lambda: torch.backends.cpu.get_cpu_capability() == "AVX512" and not avx2_so()[1].exists(),
             "from tests import background; background.avx2_kernels()"),
    "smollm2-fp32": ("test_smollm2", lambda: True,
                     "from specdec.runtime.loading import materialize; materialize('smollm2')"),
}


def start(modules: set[str]) -> None:
    """Every job a collected test module needs."""
    for name, (module, todo, code) in JOBS.items():
        if module in modules and name not in _jobs and todo():
            # `nice` the command rather than a preexec_fn: that runs Python in the child of a threaded process
            p = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", code], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            _jobs[name] = p
            atexit.register(_stop, p)


def wait(name: str) -> None:
    p = _jobs.get(name)
    if p is not None:
        p.wait()


def _stop(p: subprocess.Popen) -> None:
    """A session that ends first leaves no compiler behind (ninja's and g++'s processes too: the group)."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
