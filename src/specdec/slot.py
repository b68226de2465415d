"""Who owns a runner's KV cache and a drafter's state: what makes one Decoder safe to share.

A Decoder has one runner and one drafter, and their state belongs to one request at a time. Each
request holds a `Lease` on the Decoder's `Slot` and takes it for every decoding step:
- a request running in another thread waits until the owner finishes (requests are serialized,
  in arrival order of their first step);
- a request in the *same* thread as a suspended owner (a stream read halfway, then `generate` called)
  takes the slot over at once, since waiting would deadlock; the owner, when read again, is told its
  state was lost and rebuilds it from its own tokens (one prefill) before its next step.
So no request ever runs on another's cache: a stream continues correctly after any interleaving.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Slot:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._owner: Lease | None = None  # whose state the runner and drafter hold
        self._thread: int | None = None  # the thread of the owner's latest step
        self.takeovers = 0  # same-thread takeovers so far (for tests and stats)

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    @contextmanager
    def hold(self) -> Iterator[bool]:
        """Own the slot for one step. Yields True when the state is not ours (first step, or another
        request used the slot since our last step): the caller must (re)build it."""
        s, me = self.slot, threading.get_ident()
        with s._cv:
            while s._owner not in (None, self) and s._thread != me:
                s._cv.wait()
            lost = s._owner is not self
            if s._owner is not None and lost:
                s.takeovers += 1
            s._owner, s._thread = self, me
        yield lost

    def release(self) -> None:
        """The request is over (finished, failed or closed): the next one may start."""
        s = self.slot
        with s._cv:
            if s._owner is self:
                s._owner = s._thread = None
                s._cv.notify_all()
