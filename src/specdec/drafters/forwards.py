"""The model forwards a draft asks for (Drafter.drafting yields them), and how forks' forwards of one kind
pack into one call in a batch (drafters.base.propose_many): each output exactly what that forward gives
alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.drafters.base import DraftForward
from specdec.heads.runner import HeadRunner
from specdec.runtime.base import ForwardOut, Runner


@dataclass
class RunnerForward(DraftForward):
    """A draft model's forward (Runner.forward's arguments): forks' forwards pack into one forward_many."""

    runner: Runner
    tokens: torch.Tensor
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    logits_rows: slice | None = None

    @property
    def pack(self) -> tuple:
        return RunnerForward, self.runner.family

    @staticmethod
    def run_many(forwards: list[RunnerForward]) -> list[ForwardOut]:
        return forwards[0].runner.forward_many([(f.runner, f.tokens, f.positions, f.mask) for f in forwards],
                                               logits_rows=[f.logits_rows for f in forwards])


@dataclass
class HeadForward(DraftForward):
    """A head forward a draft asks for, and the LM head's logits of its rows `logits` (None: none): forks'
    forwards of the same kind pack into one (HeadRunner.forward_many, then one LM head call). Output:
    (f̂, the LM head's input, logits or None)."""

    runner: HeadRunner
    tokens: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    draft: bool = False
    feature: bool = True
    logits: slice | None = field(default_factory=lambda: slice(None))

    @property
    def pack(self) -> tuple:
        return HeadForward, self.runner.family, self.draft, self.feature

    @staticmethod
    def run_many(forwards: list[HeadForward]) -> list[tuple]:
        first = forwards[0]
        outs = first.runner.forward_many([(f.runner, f.tokens, f.features, f.positions, f.mask) for f in forwards],
                                         first.draft, first.feature)
        wanted = [(i, g[f.logits]) for i, (f, (_, g)) in enumerate(zip(forwards, outs)) if f.logits is not None]
        logits: list = [None] * len(forwards)
        if wanted:
            rows = [g for _, g in wanted]
            lm = first.runner.logits(rows[0] if len(rows) == 1 else torch.cat(rows))
            for (i, _), lg in zip(wanted, lm.split([g.shape[0] for g in rows])):
                logits[i] = lg
        return [(f, g, lg) for (f, g), lg in zip(outs, logits)]
