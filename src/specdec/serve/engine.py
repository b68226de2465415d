"""What the app submits requests to. `Engine` is the whole interface: `SerialEngine` decodes one request
at a time, `BatchEngine` up to --max-batch together (batch.py), each behind a bounded queue, decoding on
a worker thread of its own or on the caller's (`run`, as `specdec serve` does: see app.serve)."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from typing import Protocol

from pydantic import field_validator

from specdec.api import Chunk, Decoder, GenerationParams, TextStream
from specdec.batch import PREFILL_CHUNK, STALL, Batch
from specdec.engine import Sequence
from specdec.errors import SpecdecError
from specdec.options import Options, option
from specdec.stats import Stats

_END = object()


class Serving(Options):
    """How `specdec serve` schedules requests; checked before the model loads."""

    max_queue: int = option(64, "requests that may wait for their turn; more get 429 with Retry-After", ge=1,
                            metavar="N")
    max_batch: int = option(4, "requests decoded together, each accepting its own number of tokens per step "
                            "(1: one at a time; methods that cannot batch yet, e.g. lookahead, decode one at a time)",
                            ge=1, metavar="N")
    prefill_chunk: int = option(PREFILL_CHUNK, "rows of a batched step, decoding rows and a joining prompt's chunk "
                                "together: a long prompt goes in over several steps while the others keep "
                                "decoding (at most the runner's exact rows, 64)", ge=1, metavar="N")
    prefill_stall: float = option(STALL, "while others decode, a step carrying a joining prompt's chunk takes at "
                                  "most this many times a plain step (the chunk sized from measured step times; "
                                  "0: chunks of --prefill-chunk rows)", metavar="X")

    @field_validator("prefill_stall")
    @classmethod
    def _stall(cls, v: float) -> float:
        if v != 0 and not v >= 1:
            raise ValueError(f"must be 0 or at least 1, got {v}")
        return v


class QueueFull(Exception):
    pass


class Job:
    """One request's output as it comes: `await job.next()` gives Chunks, then None; an exception raised
    while decoding is raised there. `cancel()` (the client left) stops its decoding at its next chunk."""

    def __init__(self, prompt, params: GenerationParams) -> None:
        self.prompt, self.params = prompt, params
        self.arrived = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event) -> None:  # from the engine's thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def end(self) -> None:
        self.put(_END)

    async def next(self) -> Chunk | None:
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise event
        return None if event is _END else event


class Engine(Protocol):
    def submit(self, job: Job) -> None:
        """Queue the job (raises QueueFull when the queue is full); its chunks arrive on the job."""

    def waiting(self) -> int: ...

    def running(self) -> int: ...

    def batch_size(self) -> int:
        """Sequences in the decoding batch (stepping together, a joining prompt's chunk included) now."""

    def steps(self) -> tuple[int, int]:
        """(decode steps so far, the sequences they carried summed): the mean batch size over any span
        is the ratio of the two counters' growth."""

    def run(self) -> None:
        """Decode on the calling thread until close() (only for an engine made with thread=False)."""

    def close(self) -> None: ...


class _Worker:
    """A bounded queue of jobs and who takes them: a worker thread of the engine's own, or the thread
    that calls run() (the engines' common part)."""

    def _start(self, max_queue: int, name: str, thread: bool) -> None:
        self._steps = self._rows = 0
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def run(self) -> None:
        if self._thread is not None:
            raise RuntimeError("this engine decodes on its own thread")
        self._work()

    def _work(self) -> None:
        raise NotImplementedError

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def waiting(self) -> int:
        return self._queue.qsize()

    def steps(self) -> tuple[int, int]:
        return self._steps, self._rows

    def _stepped(self, size: int) -> None:
        self._steps, self._rows = self._steps + 1, self._rows + size

    def close(self) -> None:
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class SerialEngine(_Worker):
    """Decodes one request at a time, in arrival order, on its worker thread (or run()'s); at most
    `max_queue` wait."""

    def __init__(self, decoder: Decoder, max_queue: int = 64, thread: bool = True) -> None:
        self.decoder = decoder
        self._running = 0
        self._start(max_queue, "specdec-serve-engine", thread)

    def running(self) -> int:
        return self._running

    def batch_size(self) -> int:
        return self._running

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:
                job.end()
                continue
            self._running = 1
            try:
                self._run(job)
            except Exception as e:  # this request fails, the worker goes on
                job.put(e)
            finally:
                self._running = 0
                job.end()

    def _run(self, job: Job) -> None:
        stream = self.decoder.stream(job.prompt, **job.params.model_dump())
        try:
            for chunk in stream:
                self._stepped(1)
                job.put(chunk)
                if job.cancelled:
                    break
        finally:
            stream.close()  # releases the decoder for the next request


class BatchEngine(_Worker):
    """Decodes up to `max_batch` requests together on its worker thread or run()'s (batch.Batch): between steps,
    finished and cancelled requests leave and queued ones join, in arrival order; at most `max_queue`
    wait. A joining prompt goes in a chunk per step beside the decoding rows (prefill_chunk: a step's rows).
    Each request keeps its own sampling parameters, seed, stop strings and max tokens. Raises SpecdecError
    when the Decoder's runner or drafter cannot fork (make_engine then serves serially)."""

    def __init__(self, decoder: Decoder, max_batch: int = 4, max_queue: int = 64, thread: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK, prefill_stall: float = STALL) -> None:
        self.decoder, self.max_batch = decoder, max_batch
        self.batch = Batch(decoder.runner, decoder.drafter, decoder.eos_ids, prefill_chunk, prefill_stall)
        self._live: dict[Sequence, tuple[Job, TextStream]] = {}
        self._size = 0
        self._start(max_queue, "specdec-serve-batch", thread)

    def running(self) -> int:
        return len(self._live)

    def batch_size(self) -> int:
        return self._size

    def _work(self) -> None:
        closing = False
        while not closing or self._live:
            while not closing and len(self._live) < self.max_batch:
                try:  # idle: wait for a request; busy: take what is queued and step on
                    job = self._queue.get(block=not self._live)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                elif job.cancelled:
                    job.end()
                else:
                    self._join(job)
            for seq, (job, _) in list(self._live.items()):
                if job.cancelled:  # its client left: the slot is free for the next step
                    self._end(seq)
            self._size = len(self.batch)
            if not self._live:
                continue
            try:
                results = self.batch.step()
                self._stepped(self._size)
            except Exception as e:  # the packed forward failed: every request in it fails
                for seq, (job, _) in list(self._live.items()):
                    job.put(e)
                    self._end(seq)
                continue
            for seq, new in results:
                if isinstance(new, Exception):
                    self._live[seq][0].put(new)
                    self._end(seq)
                else:
                    self._emit(seq, new)
            self._size = len(self.batch)

    def _join(self, job: Job) -> None:
        """The request joins the batch: its prompt goes in over the next steps (batch.Batch's chunks)."""
        p = job.params
        try:
            ids = self.decoder.encode(job.prompt)
            seq = self.batch.join(ids, p, p.max_new_tokens, Stats(), self.decoder.constraint(p))
        except Exception as e:  # this request fails, the others go on
            job.put(e)
            job.end()
            return
        self._live[seq] = (job, TextStream(self.decoder, ids, p.stop, seq.stats))

    def _emit(self, seq: Sequence, new: list[int]) -> None:
        job, text = self._live[seq]
        chunk = text.push(new) if new else None
        if chunk is not None:
            job.put(chunk)
        if text.stopped or seq.done:
            job.put(text.final())
            self._end(seq)

    def _end(self, seq: Sequence) -> None:
        job, _ = self._live.pop(seq)
        self.batch.leave(seq)
        job.end()


def make_engine(decoder: Decoder, max_batch: int = 1, max_queue: int = 64, thread: bool = True,
                prefill_chunk: int = PREFILL_CHUNK, prefill_stall: float = STALL) -> Engine:
    """BatchEngine for max_batch > 1 where the method can fork per request; else SerialEngine (a note
    on stderr says why). thread=False: it decodes on the thread that calls its run()."""
    if max_batch > 1:
        try:
            return BatchEngine(decoder, max_batch, max_queue, thread, prefill_chunk, prefill_stall)
        except SpecdecError as e:
            print(f"specdec serve: {e}: requests decode one at a time", file=sys.stderr)
    return SerialEngine(decoder, max_queue, thread)
