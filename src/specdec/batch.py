"""Continuous batching: sequences decoded together, each accepting its own number of tokens every step
(iteration-level scheduling, as in Orca and vLLM). Sequences join and leave between steps.

A step: every sequence's drafter proposes (engine.Sequence.plan, one sequence after another), ONE
target forward verifies all their rows (Runner.forward_many: the linears run once on every row, each
sequence attends over its own cache), then each sequence verifies and commits its own rows
(Sequence.apply). Each sequence owns a fork of the target runner (its KV cache) and of the drafter (its
state) over shared weights; a row's bits are those it gets decoded alone, so every sequence emits what it
would emit alone. A joining sequence's prompt is prefilled on its own, between steps.

A sequence's ctx.forward_s here spans the packed forward and its neighbours' drafting and verification,
not a price of its own rows: drafters that learn prices from it (adaptive `auto`) fork without their clock,
drafting by the costs they had, each row priced as its share of the packed forward (ctx.sharing)."""

from __future__ import annotations

import time

from specdec.drafters.base import Drafter
from specdec.engine import Sequence, Stats
from specdec.errors import SpecdecError
from specdec.grammar import Constraint
from specdec.runtime.base import Runner
from specdec.sampling import SamplingParams


class Batch:
    def __init__(self, runner: Runner, drafter: Drafter, eos_ids: set[int]) -> None:
        """runner and drafter: the templates every sequence forks (their own state is never used)."""
        self.runner, self.drafter, self.eos_ids = runner, drafter, eos_ids
        self.active: list[Sequence] = []
        self._free: list[tuple[Runner, Drafter]] = []  # forks of sequences that left, for the next to join
        self._start: dict[Sequence, float] = {}
        r, d = runner.fork(), drafter.fork()
        if r is None:
            raise SpecdecError(f"this target's runner ({runner.kernel_path}) cannot decode several sequences at once")
        if d is None:
            raise SpecdecError(f"drafter {drafter.name!r} cannot decode several sequences at once yet")
        self._free.append((r, d))

    def join(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
             stats: Stats | None = None, constraint: Constraint | None = None) -> tuple[Sequence, list[int]]:
        """A new sequence, prefilled: (it, its first tokens). It is in `active` unless already done.
        constraint: the grammar its answer follows (grammar.Constraint)."""
        runner, drafter = self._free.pop() if self._free else (self.runner.fork(), self.drafter.fork())
        t0 = time.perf_counter()
        try:
            seq = Sequence(runner, drafter, prompt_ids, params, max_new_tokens, self.eos_ids, stats or Stats(),
                           constraint=constraint)
            first = seq.prefill()
        except BaseException:
            self._free.append((runner, drafter))
            raise
        seq.stats.prefill_time = time.perf_counter() - t0
        self._start[seq] = t0
        self.active.append(seq)
        if seq.done:
            self.leave(seq)
        return seq, first

    def leave(self, seq: Sequence) -> None:
        """The sequence stops (done, or its client left): its forks serve the next one to join."""
        if seq in self.active:
            self.active.remove(seq)
            seq.finish()
            seq.stats.total_time = time.perf_counter() - self._start.pop(seq)
            self._free.append((seq.runner, seq.drafter))

    def step(self) -> list[tuple[Sequence, list[int] | Exception]]:
        """One step of every active sequence: its new tokens ([] if it ran out of context), or the
        exception its drafting or verification raised (it has left). Done sequences leave."""
        results: list[tuple[Sequence, list[int] | Exception]] = []
        planned = []
        for seq in list(self.active):
            seq.ctx.sharing = len(self.active)  # drafters price their rows as a share of the packed forward
            try:
                rows = seq.plan()
            except Exception as e:  # this sequence fails, the others go on
                self.leave(seq)
                results.append((seq, e))
                continue
            if rows is None:
                self.leave(seq)
                results.append((seq, []))
            else:
                planned.append((seq, rows))
        if not planned:
            return results
        outs = self.runner.forward_many([(seq.runner, *rows) for seq, rows in planned], self.drafter.aux_layers)
        for (seq, _), out in zip(planned, outs):
            try:
                results.append((seq, seq.apply(out)))
            except Exception as e:
                results.append((seq, e))
                self.leave(seq)
                continue
            if seq.done:
                self.leave(seq)
        return results
