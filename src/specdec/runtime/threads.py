"""Torch's thread count while decoding: as the user fixed it, or following the CPUs other processes leave free.

Why follow: a count chosen once at load pins a process that loaded during a busy second to one thread for
its life (SmolLM2 76 tok/s against 87-98 quiet), and one that loaded quiet to two threads beside a busy
process (a 2-thread decode beside one ran at 0.9 tok/s: OpenMP's barriers wait for the preempted thread).
The decoding loops call tick() between forwards, never inside one; it re-reads the machine at most every
EVERY_S, from /proc counters (microseconds, no sleep), and changes the count only after CONFIRM readings in a
row agree on a new one, so a busy moment shorter than that (0.5 s) moves nothing. A row's bits do not depend
on the thread count: the native kernels split work over output rows, never over a reduction, and the fallbacks
(oneDNN's packed GEMMs, MKL's GEMV, SDPA) gave the same bits at 1 and 2 threads here; tests/test_threads.py
switches it mid-generation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from specdec.runtime import cpus

# Why a quarter second: with readings a second apart, a process loaded during a 1-s busy loop kept one thread
# for ~2 s of its first answer (SmolLM2, 256 tokens: 0.84-0.88x a quiet load's speed; 0.91-0.94x at 0.25 s)
EVERY_S = 0.25
CONFIRM = 2


class Controller(Protocol):
    def tick(self) -> None:
        """Between two forwards, on the decoding thread: set torch's threads if they should change."""


class Follower:
    """Threads = the CPUs other processes leave free (cpus.free_cpus' rule, over the time since the last
    reading), at most `ceiling`; a new count once `confirm` readings in a row agree on it."""

    def __init__(self, ceiling: int, threads: int, every_s: float = EVERY_S, confirm: int = CONFIRM,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ceiling, self.threads, self.every_s, self.confirm, self.clock = ceiling, threads, every_s, confirm, clock
        self.readings: list[int] = []
        self.changes = 0
        self._meter, self._since = cpus.ContentionMeter(), clock()

    def tick(self) -> None:
        now = self.clock()
        if now - self._since >= self.every_s:
            free = min(self.ceiling, cpus.free_of(self._meter.result()))
            self._meter, self._since = cpus.ContentionMeter(), now
            self.readings = (self.readings + [free])[-self.confirm:]
            if len(self.readings) == self.confirm and set(self.readings) == {free} and free != self.threads:
                self.threads = free
                self.changes += 1
        # per calling thread: OpenMP keeps a count per thread, and requests may decode on several
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


_controller: Controller | None = None  # None: the count stays as it is
_usual: int | None = None  # torch's own count, before anything here changed it


def _default() -> int:
    global _usual
    if _usual is None:
        _usual = torch.get_num_threads()
    return _usual


def tick() -> None:
    """The decoding loops' one call per step (engine.decode, batch.Batch.step)."""
    if _controller is not None:
        _controller.tick()


def install(controller: Controller | None) -> Controller | None:
    """Make `controller` the process's (None: nothing moves the count); returns the one it replaces."""
    global _controller
    old, _controller = _controller, controller
    return old


def fix(threads: int) -> None:
    """The user's count: set now, never moved."""
    _default()
    install(None)
    torch.set_num_threads(threads)


def follow() -> str | None:
    """From now on the count follows the machine, at most torch's own count: set now from a short measurement
    (cpus.free_cpus), then moved by tick(). A one-line note when others leave fewer CPUs than usual."""
    usual = _default()
    free = min(usual, cpus.free_cpus())
    torch.set_num_threads(free)
    install(Follower(usual, free))
    if free >= usual:
        return None
    n = cpus.usable_cpus()
    return (f"another process is keeping {n - free} of {n} CPUs busy: using {free} thread{'s' if free > 1 else ''} "
            "for now (--threads N to choose)")


@contextmanager
def pinned(threads: int) -> Iterator[None]:
    """`threads` and nothing moves them inside (a benchmark's timed run); as before afterwards."""
    before, old = torch.get_num_threads(), install(None)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        install(old)
