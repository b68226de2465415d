"""`specdec chat`: a conversation with a model loaded once. Each answer streams as it is decoded (the
public `Decoder.stream`), then a statistics line for the turn goes to stderr. The history is the chat
template's messages; an answer stopped by Ctrl-C stays in it as far as it was shown."""

from __future__ import annotations

import bisect
import contextlib
import sys
from collections.abc import Iterator

from specdec.api import Chunk, Decoder, Generation, GenerationParams
from specdec.cli.output import detail_line, end_answer, say, write_answer
from specdec.detok import GrowingText
from specdec.errors import SpecdecError

PROMPT = ">>> "
HELP = "/reset clears the history, /exit or Ctrl-D quits; Ctrl-C stops an answer (at the prompt: quits)"


class Conversation:
    """The messages of one conversation. `send` streams the answer to a new user message; `keep` then
    records what the user saw of it (all of it, or what was shown before Ctrl-C)."""

    def __init__(self, dec: Decoder, params: GenerationParams, system: str | None = None):
        self.dec, self.params, self.system = dec, params, system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str) -> Iterator[Chunk]:
        self.messages.append({"role": "user", "content": text})
        try:
            return self.dec.stream(self.messages, **self.params.model_dump())
        except SpecdecError:
            self.messages.pop()
            raise

    def keep(self, reply: str) -> None:
        if reply:
            self.messages.append({"role": "assistant", "content": reply})
        else:  # nothing shown (an error, or Ctrl-C before the first token): the turn did not happen
            self.messages.pop()

    def ask(self, text: str) -> Generation:
        """One whole turn, for scripts and tests."""
        final = None
        for chunk in self.send(text):
            final = chunk.final or final
        self.keep(final.text)
        return final


# ANSI colours by how a token was produced: sampled by the target, or an accepted draft at depth 1, 2, 3, 4+
COLORS = ["33", "32", "36", "34", "35"]
RESET = "\x1b[0m"


def _color(depth: int) -> str:
    return f"\x1b[{COLORS[min(depth, len(COLORS) - 1)]}m"


def legend() -> str:
    names = ["target", "draft depth 1", "2", "3", "4+"]
    return "colours: " + " ".join(f"{_color(d)}{n}{RESET}" for d, n in enumerate(names))


class Painter:
    """Colours an answer's streamed text by the tokens it came from (Chunk.depths). The text itself is
    written unchanged: removing the colour codes gives the plain answer."""

    def __init__(self, tokenizer):
        self.text = GrowingText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.depths: list[int] = []
        self.ends: list[int] = []  # where each token's text ends in the answer
        self.pos = 0  # characters of the answer painted so far

    def paint(self, chunk: Chunk) -> str:
        for tok, depth in zip(chunk.token_ids, chunk.depths):
            self.depths.append(depth)
            text = self.text.extend([tok]).rstrip("\ufffd")
            self.ends.append(max(len(text), self.ends[-1] if self.ends else 0))
        out, current = [], None
        for i, ch in enumerate(chunk.text, self.pos):
            k = min(bisect.bisect_right(self.ends, i), len(self.depths) - 1)
            color = _color(self.depths[k]) if k >= 0 else ""
            if color != current:
                out.append(color)
                current = color
            out.append(ch)
        self.pos += len(chunk.text)
        return "".join(out) + (RESET if chunk.text else "")


def turn_line(dec: Decoder, gen: Generation) -> str:
    s = gen.stats
    accepted = sum(a - 1 for a in s.accept_lengths)
    return (f"[{dec.drafter.name}] {s.new_tokens} tokens in {s.total_time:.2f} s = {s.tokens_per_second:.1f} "
            f"tok/s | tau {s.tau:.2f} | {accepted} draft tokens accepted | finish: {gen.finish_reason}")


def _read(tty: bool) -> str | None:
    """The next line, None at the end of input."""
    if tty:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def repl(dec: Decoder, params: GenerationParams, args) -> int:

    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        say(args, f"specdec chat: {dec.drafter.name}, {dec.weights} weights. {HELP}")
    if args.color_draft:
        say(args, legend())
    conv = Conversation(dec, params, args.system)
    while True:
        try:
            line = _read(tty)
        except KeyboardInterrupt:  # at the prompt: leave
            print()
            return 0
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            conv.reset()
            say(args, "(history cleared)")
            continue
        if text.startswith("/") and " " not in text:
            say(args, f"unknown command {text}: {HELP}")
            continue
        painter = Painter(dec.tokenizer) if args.color_draft else None
        shown: list[str] = []
        final = None
        try:
            stream = conv.send(line)
        except SpecdecError as e:
            print(f"specdec: error: {e}", file=sys.stderr, flush=True)
            continue
        try:
            for chunk in stream:
                shown.append(chunk.text)
                write_answer(painter.paint(chunk) if painter else chunk.text)
                final = chunk.final or final
        except KeyboardInterrupt:  # stop this answer, keep what was shown, back to the prompt
            if any(shown) or tty:  # a terminal shows ^C on the answer's line
                end_answer()
            say(args, "(answer stopped)")
        except SpecdecError as e:  # e.g. the history outgrew the model's context
            if any(shown):
                end_answer()
            print(f"specdec: error: {e} (/reset clears the history)", file=sys.stderr, flush=True)
        else:
            end_answer()
            say(args, turn_line(dec, final))
            if args.verbose:
                say(args, detail_line(final.stats))
        finally:
            stream.close()
            conv.keep("".join(shown))
