"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a 2-D window of guessed tokens makes
n-grams, the n-grams that start with the last emitted token become the draft. No model, no training.

The window holds up to N - 1 levels of W tokens; level l, column j sits j + l + 1 positions after the
root and sees the root, level 0's columns 0..j and its own column's lower levels: one sequence along
that diagonal. Each verify forward carries the window as side rows (drafters.base.SideRows): the
tree never sees them and the cache drops them. The top level's argmax becomes the next level; once N - 1
levels exist, each column's diagonal plus that new token is an n-gram for the pool (keyed by its first
token, the latest G per key), and the oldest level is dropped. As the authors' implementation does with
POOL_FROM_PROMPT (their setting for the paper's runs), the pool starts with the prompt's own n-grams.

The draft is up to G pooled n-grams after the root, merged into one tree: point masses the verifier
checks like any draft, so decoding stays exact at any temperature. The window itself follows the
target's argmax whatever the temperature: it never draws from the request's generator.
"""

from __future__ import annotations

import random

import torch
from pydantic import model_validator

from specdec.drafters.base import DecodeContext, Drafter, SideRows
from specdec.drafters.registry import Method, Options, option, register
from specdec.errors import SpecdecError
from specdec.sampling import argmax_rows
from specdec.tree import DraftTree

MAX_ROWS = 64  # the rows of a forward whose bits the lean runner keeps exact (runtime/lean.py EXACT_ROWS)


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, window: int = 1, ngram_size: int = 3, guesses: int = 1, pool_from_prompt: bool = True) -> None:
        if window < 1 or ngram_size < 2 or guesses < 1:
            raise SpecdecError(f"lookahead needs window >= 1, ngram_size >= 2 and guesses >= 1, got window={window}, "
                               f"ngram_size={ngram_size}, guesses={guesses}")
        self.window, self.ngram_size, self.guesses = window, ngram_size, guesses
        self.pool_from_prompt = pool_from_prompt
        self.draft_depth = ngram_size - 1
        self.levels: list[list[int]] = []
        self.pool: dict[int, dict[tuple[int, ...], None]] = {}  # first token -> the rests, oldest first
        self.sent = 0  # levels in the side rows of the last forward

    def begin(self, ctx: DecodeContext) -> None:
        # level 0 from the context's own tokens (as the paper seeds it from the prompt), fixed seed: reproducible
        pick = random.Random(0)
        self.levels = [[pick.choice(ctx.tokens) for _ in range(self.window)]]
        self.pool = {}
        if self.pool_from_prompt:
            n = self.ngram_size
            for i in range(len(ctx.tokens) - n + 1):
                self._remember(tuple(ctx.tokens[i:i + n]))

    def propose(self, ctx: DecodeContext) -> DraftTree:
        grams = list(self.pool.get(ctx.tokens[-1], ()))[::-1]  # the latest first
        tree = DraftTree.empty()
        for gram in grams[: self.guesses]:
            tree = tree.union(DraftTree.chain(torch.tensor(gram)))
        return tree.truncate_depth(ctx.max_nodes) if tree.max_depth > ctx.max_nodes else tree

    def side_rows(self, ctx: DecodeContext) -> SideRows | None:
        if not self.levels:
            return None
        self.sent = len(self.levels)
        w, k = self.window, self.sent
        lvl = torch.arange(k).repeat_interleave(w)
        col = torch.arange(w).repeat(k)
        # a row sees level 0 up to its column, and its own column at levels 1..its own
        sees = ((lvl[None, :] == 0) & (col[None, :] <= col[:, None])) | \
            ((col[None, :] == col[:, None]) & (lvl[None, :] <= lvl[:, None]))
        return SideRows(torch.tensor([t for level in self.levels for t in level]), lvl + col + 1, sees)

    def side_logits(self, logits: torch.Tensor) -> None:
        if self.sent != len(self.levels):
            return
        top = argmax_rows(logits[-self.window:])
        if len(self.levels) < self.ngram_size - 1:  # still filling the window
            self.levels.append(top)
            return
        for j, nxt in enumerate(top):
            self._remember(tuple(level[j] for level in self.levels) + (nxt,))
        self.levels = self.levels[1:] + [top]

    def _remember(self, gram: tuple[int, ...]) -> None:
        seen = self.pool.setdefault(gram[0], {})
        seen.pop(gram[1:], None)  # seen again: now the latest
        seen[gram[1:]] = None
        if len(seen) > self.guesses:
            del seen[next(iter(seen))]


class LookaheadOptions(Options):
    # W 1, G 1: the fastest setting measured on a 2-core CPU, where every verify row costs (docs/benchmarks.md)
    window: int = option(1, "W: Jacobi window width (tokens guessed ahead per level)", ge=1)
    ngram_size: int = option(3, "N: length of the n-grams the window makes (N - 1 levels; the draft's depth)", ge=2)
    guesses: int = option(1, "G: pooled n-grams verified per step (and kept per first token)", ge=1)
    pool_from_prompt: bool = option(True, "start the pool with the prompt's n-grams (the authors' POOL_FROM_PROMPT)")

    @model_validator(mode="after")
    def _fits(self):
        rows = 1 + (self.window + self.guesses) * (self.ngram_size - 1)
        if rows > MAX_ROWS:
            raise ValueError(f"1 + (window + guesses) * (ngram_size - 1) rows must be at most {MAX_ROWS} (a "
                             f"forward the runner keeps exact), got {rows}")
        return self


register(Method("lookahead", "lookahead decoding: a Jacobi window rides in each verify forward and makes n-grams; "
                "those after the last token are the draft (Fu et al.)", LookaheadOptions,
                lambda t, o: LookaheadDrafter(o.window, o.ngram_size, o.guesses, o.pool_from_prompt)))
