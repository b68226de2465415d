"""What every command's argument parser shares."""

from __future__ import annotations

import argparse


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Bad arguments print one line like every other specdec error (exit 2), not a usage block."""
    p.error = lambda message: p.exit(2, f"specdec: error: {message} (see `{p.prog} -h`)\n")
    return p
