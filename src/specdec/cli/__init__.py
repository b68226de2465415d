"""`specdec` command line (the console entry point). Errors users can fix are printed as one line,
without a traceback; so is a Ctrl-C, even one during the seconds torch takes to import.

This package's top imports only the standard library: the commands live in specdec.cli.commands (and
`chat`), imported inside `main` where an interrupt is caught."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from specdec.errors import SpecdecError

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def main(argv: list[str] | None = None) -> int:
    try:
        _import_torch()
        from specdec.cli.commands import run

        return run(argv)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdec: interrupted" if _mid_line() else "specdec: interrupted", file=sys.stderr)
        if argv is None:  # this is the process (the console script, or python -m specdec.cli)
            # an interrupt that landed in code a library runs through the C API (PyRun_String) marks the
            # interpreter to kill itself by SIGINT at exit, even though it was caught: exit here instead
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(INTERRUPTED)
        return INTERRUPTED
    except BrokenPipeError:  # the reader left (`specdec generate ... | head -2`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 141


def _import_torch() -> None:
    """torch's start-up with Ctrl-C held back: an interrupt inside its C++ initialisation aborts the process
    ("terminate called ...", exit -6) instead of raising KeyboardInterrupt. A Ctrl-C meanwhile is delivered
    as soon as the import is done, where `main` turns it into one line."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to hold back with
        import torch  # noqa: F401
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _mid_line() -> bool:
    """Whether a streamed answer was cut on a terminal line the message must not be glued to."""
    mod = sys.modules.get("specdec.cli.output")
    return bool(mod and mod.stdout_mid_line())


def __getattr__(name: str):
    # build_parser, DEFAULT_PROMPT, ...: importers of specdec.cli get the commands module's names
    import importlib

    return getattr(importlib.import_module("specdec.cli.commands"), name)
