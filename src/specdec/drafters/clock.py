"""Costs that follow the machine while decoding: StepClock compares each verify forward and its drafting
with their prices (rescaled between requests, no probe); CatchUp learns a head's catch-up per row."""

from __future__ import annotations

import bisect

# forward sizes that share an online scale (lower bounds): one row is bandwidth-bound, wide ones compute-bound,
# and another process's load slows the two differently
SIZE_CLASSES = (1, 2, 5, 9, 17)
# a head after a drafted step reads TYPICAL_ROWS rows (the accepted token and the bonus); after plain steps
# more, each priced up to PRICED_ROWS: that catch-up is paid once for all the drafting after it, so a long
# plain stretch must not price every later try out
TYPICAL_ROWS, PRICED_ROWS = 2, 8


def size_class(n: int) -> int:
    return max(bisect.bisect_right(SIZE_CLASSES, n) - 1, 0)


class StepClock:
    """Observed over priced seconds, decayed over the last ~100 steps of all requests: per size class, in
    total and for drafting. Why: costs are cached per machine, not per load (measured while another process
    ran, they priced drafting as free on the idle machine for good)."""

    MIN_SEEN = 3.0  # decayed drafted steps before the drafting ratio is trusted
    PRIOR_STEPS = 16.0  # a size class's ratio counts the overall one as this many of its steps
    CLASS_SEEN = 8.0  # decayed steps of a class (or of drafting) before its own ratio can say it drifted
    LOG_CAP = 4096  # noted forwards before they must be priced

    def __init__(self, drift: float = 1.1, min_steps: int = 64, decay: float = 0.99) -> None:
        self.drift, self.min_steps, self.decay = drift, min_steps, decay
        # decayed (seen, priced, steps): one per size class, then all forwards, then the drafting
        self.sums = [[0.0, 0.0, 0.0] for _ in range(len(SIZE_CLASSES) + 2)]
        self.steps = 0
        self.log: list[tuple[float, int, int]] = []  # (seconds, rows, context) of forwards not yet priced

    def note(self, seconds: float, rows: int, ctx: int) -> bool:
        """A verify forward, priced later (settle: right after a forward the caches are cold, ~25 us a call
        where warm takes 0.6); whether the log is full."""
        self.log.append((seconds, rows, ctx))
        return len(self.log) >= self.LOG_CAP

    def settle(self, price) -> None:
        """Price the noted forwards (price(rows, ctx): their seconds now) and observe them."""
        log, self.log = self.log, []
        for seconds, rows, ctx in log:
            self.observe(seconds, price(rows, ctx), rows)

    def _add(self, i: int, seconds: float, priced: float) -> None:
        c = self.sums[i]
        c[0], c[1], c[2] = c[0] + seconds, c[1] + priced, c[2] + 1.0

    def observe(self, seconds: float, priced: float, rows: int = 1) -> None:
        for c in self.sums[:-1]:
            c[:] = [self.decay * x for x in c]
        self._add(size_class(rows), seconds, priced)
        self._add(len(SIZE_CLASSES), seconds, priced)
        self.steps += 1

    def observe_draft(self, seconds: float, priced: float) -> None:
        """A drafted step's propose() (a head's catch-up included) against its price."""
        self.sums[-1][:] = [self.decay * x for x in self.sums[-1]]
        self._add(-1, seconds, priced)

    def _off(self, c: list[float]) -> bool:
        return c[1] > 0 and not 1 / self.drift <= c[0] / c[1] <= self.drift

    @property
    def drifted(self) -> bool:
        """Enough steps ran, off their price by more than `drift` either way: in total, in a well-observed size
        class, or in drafting. Why per class: one-row forwards 15% under their price beside wider ones 9%
        under flipped choices near break-even (the README demo prompt at 0.92x vanilla)."""
        if self.steps < self.min_steps:
            return False
        *classes, total, draft = self.sums
        return self._off(total) or any(self._off(c) for c in [*classes, draft] if c[2] >= self.CLASS_SEEN)

    def draft_factor(self) -> float | None:
        """Observed / priced drafting, or None if too few drafted steps ran."""
        seen, priced, steps = self.sums[-1]
        return seen / priced if steps >= self.MIN_SEEN and priced > 0 else None

    def factors(self) -> list[float]:
        """Observed / priced per size class, shrunk toward the overall ratio by PRIOR_STEPS steps. Why: three
        wide forwards during a hiccup read as 1.45x their price, and every later process drafted less."""
        *classes, (seen, priced, _), _ = self.sums
        overall = seen / priced if priced > 0 else 1.0
        out = []
        for seen, priced, steps in classes:
            w = self.PRIOR_STEPS * priced / steps if steps > 0 else 0.0  # PRIOR_STEPS of the class's typical price
            out.append((seen + w * overall) / (priced + w) if priced > 0 else overall)
        return out

    def restarted(self) -> StepClock:
        """A clock for the prices just learned from this one."""
        return StepClock(self.drift, self.min_steps, self.decay)


class CatchUp:
    """What a head pays per row to read the rows of plain steps before its next tree (past TYPICAL_ROWS, at
    most PRICED_ROWS priced): measured at load, then learned from the drafts that paid it. Why learned: the
    probe reads rows back to back (0.02 ms a row on SmolLM2), where on the README demo prompt a tree after
    plain steps took 2.5 ms against 1.3 priced, and its trees, none accepted, kept being tried."""

    PRIOR_ROWS, DECAY = 4.0, 0.85

    def __init__(self, prior_row_s: float) -> None:
        self.seconds, self.rows = self.PRIOR_ROWS * prior_row_s, self.PRIOR_ROWS
        self.pending = (0, 0.0)  # (rows counted, the drafting's price without them) to learn from

    @staticmethod
    def extra_rows(pending: list) -> int:
        """Rows of a head's queued steps (EagleDrafter.pending) past TYPICAL_ROWS, counted as far as priced."""
        rows = 0
        for f, _ in pending:
            rows += f.shape[0]
            if rows > TYPICAL_ROWS + PRICED_ROWS:
                break
        return max(0, rows - TYPICAL_ROWS)

    @property
    def row_s(self) -> float:
        return self.seconds / self.rows

    def price(self, extra: int) -> float:
        return self.row_s * min(extra, PRICED_ROWS)

    def drafted(self, extra: int, base: float) -> None:
        self.pending = (extra, base) if 0 < extra <= PRICED_ROWS else (0, 0.0)

    def observe(self, draft_s: float) -> None:
        """The drafting just timed: what it took beyond its price is the catch-up of the rows it read."""
        extra, base = self.pending
        if extra:
            d = self.DECAY ** extra
            self.seconds, self.rows = d * self.seconds + max(0.0, draft_s - base), d * self.rows + extra
            self.pending = (0, 0.0)
