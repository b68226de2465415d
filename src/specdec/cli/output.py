"""What the answering commands print: the answer on stdout (its line ended apart from the statistics),
notes on stderr unless -q, and -v's detail line. Shared by `generate` and `chat`."""

from __future__ import annotations

import sys


def say(args, line: str) -> None:
    """A note on stderr, unless -q."""
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def detail_line(s) -> str:
    """-v: what the drafter chose and how its drafts fared, beyond the statistics line."""
    alpha = ", ".join(f"{a:.2f}" for a in s.alpha_by_depth) or "-"
    return (f"  prompt {s.prompt_tokens} tokens | drafter {s.drafter} | costs {s.costs or 'none'} | "
            f"acceptance {s.acceptance} | alpha by depth [{alpha}] | tokens per forward {s.accept_histogram()} | "
            f"draft sizes {s.tree_size_histogram()} | wait {s.wait_time:.2f} s, resumes {s.resumes}")


_mid_line = False  # an answer was streamed to a terminal and its line not yet ended


def stdout_mid_line() -> bool:
    return _mid_line


def write_answer(text: str) -> None:
    global _mid_line
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
        _mid_line = sys.stdout.isatty() and not text.endswith("\n")


def end_answer() -> None:
    """The answer ends its line on stdout, apart from the statistics on stderr."""
    global _mid_line
    sys.stdout.write("\n")
    sys.stdout.flush()
    _mid_line = False
