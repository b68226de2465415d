"""Costs that follow the machine while decoding: StepClock compares every verify forward (and the drafting
before it) with its price, so the prices are rescaled between requests without a probe; CatchUp learns
what a head's catch-up of skipped steps costs per row."""

from __future__ import annotations

import bisect

import torch

# forward sizes that share an online scale (lower bounds): one row is bandwidth-bound, wide ones compute-bound,
# and another process's load slows the two differently
SIZE_CLASSES = (1, 2, 5, 9, 17)


def size_class(n: int) -> int:
    return max(bisect.bisect_right(SIZE_CLASSES, n) - 1, 0)


class StepClock:
    """How the observed verify forwards compare with their price, over the last ~100 steps of all
    requests, in total and per size class. Why: costs are cached per machine, not per load: measured
    while another process ran (t(1) 35 ms, flat to t(3)), they priced drafting as free on the idle
    machine (t(1) 15 ms) for good; and a forward timed by a probe (the least disturbed of a few) sits
    below a typical step under load. `factors` turns what was seen into new prices (Costs.rescaled)."""

    MIN_SEEN = 3.0  # decayed drafted steps before the drafting ratio is trusted
    PRIOR_STEPS = 16.0  # a size class's ratio counts the overall ratio as this many of its steps
    CLASS_SEEN = 8.0  # decayed steps of a size class before its own ratio alone can say the prices drifted

    def __init__(self, drift: float = 1.1, min_steps: int = 64, decay: float = 0.99) -> None:
        self.drift, self.min_steps, self.decay = drift, min_steps, decay
        self.seen = self.priced = 0.0
        # decayed (seen, priced, steps) per size class, as of step `at` of each (decayed further when next read)
        self.by_class = [[0.0, 0.0, 0.0] for _ in SIZE_CLASSES]
        self.at = [0] * len(SIZE_CLASSES)
        self.draft = [0.0, 0.0, 0.0]  # decayed (seen, priced, steps) of the drafting before a verify
        self.steps = 0
        self.log: list[tuple[float, int, int]] = []  # (seconds, rows, context) of forwards not yet priced

    LOG_CAP = 4096  # noted forwards before they must be settled

    def note(self, seconds: float, rows: int, ctx: int) -> bool:
        """A verify forward, priced when the clock is next read (settle); whether the log is full. Why later:
        work right after a forward runs with the caches it left cold (~25 us here where a warm call takes
        0.6 us), and this runs every step."""
        self.log.append((seconds, rows, ctx))
        return len(self.log) >= self.LOG_CAP

    def settle(self, price) -> None:
        """Price the noted forwards (price(rows, ctx): their seconds now) and observe them."""
        log, self.log = self.log, []
        for seconds, rows, ctx in log:
            self.observe(seconds, price(rows, ctx), rows)

    def observe(self, seconds: float, priced: float, rows: int = 1) -> None:
        d = self.decay
        self.seen = d * self.seen + seconds
        self.priced = d * self.priced + priced
        hit = size_class(rows)
        c = self._class(hit)  # the others decay when next read: a step touches one class
        c[0], c[1], c[2] = d * c[0] + seconds, d * c[1] + priced, d * c[2] + 1.0
        self.steps += 1
        self.at[hit] = self.steps

    def _class(self, i: int) -> list[float]:
        """Size class i's (seen, priced, steps) decayed up to the last observed step."""
        c, lag = self.by_class[i], self.steps - self.at[i]
        if lag:
            f = self.decay ** lag
            c[0], c[1], c[2] = f * c[0], f * c[1], f * c[2]
            self.at[i] = self.steps
        return c

    def classes(self) -> list[list[float]]:
        return [self._class(i) for i in range(len(SIZE_CLASSES))]

    def observe_draft(self, seconds: float, priced: float) -> None:
        """A drafted step's propose() (the head's catch-up included) against its price."""
        d, c = self.decay, self.draft
        c[0], c[1], c[2] = d * c[0] + seconds, d * c[1] + priced, d * c[2] + 1

    def _off(self, seen: float, priced: float) -> bool:
        return priced > 0 and not 1 / self.drift <= seen / priced <= self.drift

    @property
    def drifted(self) -> bool:
        """Enough steps ran, and they took more than `drift` times, or less than 1/drift of, their price:
        in total, in a well-observed size class, or in drafting. Why per class: a one-row forward 15%
        cheaper than its price beside wider ones 9% cheaper is 13% off in total, yet it flips the choice
        near break-even (measured: the README demo prompt at 0.92x vanilla)."""
        if self.steps < self.min_steps or self.priced <= 0:
            return False
        classes = [c for c in self.classes() if c[2] >= self.CLASS_SEEN]
        draft = [self.draft] if self.draft[2] >= self.CLASS_SEEN else []
        return self._off(self.seen, self.priced) or any(self._off(c[0], c[1]) for c in classes + draft)

    def draft_factor(self) -> float | None:
        """Observed / priced drafting, or None if too few drafted steps ran."""
        c = self.draft
        return c[0] / c[1] if c[2] >= self.MIN_SEEN and c[1] > 0 else None

    def factors(self) -> list[float]:
        """Observed / priced per size class, each class's own ratio shrunk toward the overall one by
        PRIOR_STEPS steps at it: a class seen a few times takes mostly the overall ratio. Why: three wide
        forwards during a hiccup read as 1.45x their price (t(5) 18.8 ms where decoding ran them in 12.5),
        and every later process drafted less."""
        overall = self.seen / self.priced if self.priced > 0 else 1.0
        out = []
        for seen, priced, steps in self.classes():
            w = self.PRIOR_STEPS * priced / steps if steps > 0 else 0.0  # PRIOR_STEPS of this class's typical price
            out.append((seen + w * overall) / (priced + w) if priced > 0 else overall)
        return out

    def restarted(self) -> StepClock:
        """A clock for the prices just learned from this one."""
        return StepClock(self.drift, self.min_steps, self.decay)


class CatchUp:
    """What a head tree after plain steps pays first to read their rows (EagleDrafter.sync), per row past a
    drafted step's TYPICAL_ROWS: measured at load (Costs.catch_row_s), then learned from the drafts that
    paid it. Unpriced (4.1 ms after a plain stretch against 3.4 ms priced, SmolLM2), `auto` kept trying
    near break-even at a loss (README demo prompt: 0.92x vanilla). At most PRICED_ROWS are priced: the
    catch-up is paid once for all the drafting after it, so a long stretch must not price every later try
    out. (A prior of half a step's follow per row, ~1 ms, priced most tries out: MT-bench 1.09x -> 1.03x.)"""

    TYPICAL_ROWS, PRICED_ROWS, PRIOR_ROWS, DECAY = 2, 8, 4.0, 0.85

    def __init__(self, prior_row_s: float) -> None:
        self.seconds, self.rows = self.PRIOR_ROWS * prior_row_s, self.PRIOR_ROWS
        self.pending = (0, 0.0)  # (rows beyond a typical step's, the drafting's price without them) to learn

    @property
    def row_s(self) -> float:
        return self.seconds / self.rows

    def extra_rows(self, pending: list[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
        """Rows of the head's queued steps past a typical step's, counted only as far as priced (the queue
        grows by a step on every plain step)."""
        rows = 0
        for f, _ in pending:
            rows += f.shape[0]
            if rows > self.TYPICAL_ROWS + self.PRICED_ROWS:
                break
        return max(0, rows - self.TYPICAL_ROWS)

    def price(self, extra: int) -> float:
        return self.row_s * min(extra, self.PRICED_ROWS)

    def drafted(self, extra: int, base: float) -> None:
        """A head tree read `extra` rows first (0: none to learn from), its drafting priced `base` without
        them; learned only when all were counted."""
        self.pending = (extra, base) if 0 < extra <= self.PRICED_ROWS else (0, 0.0)

    def observe(self, draft_s: float) -> None:
        """The drafting just timed: what it took beyond its price is the catch-up of the rows it read."""
        extra, base = self.pending
        if extra:
            d = self.DECAY ** extra
            self.seconds = d * self.seconds + max(0.0, draft_s - base)
            self.rows = d * self.rows + extra
            self.pending = (0, 0.0)
