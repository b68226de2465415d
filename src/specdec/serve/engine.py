"""What the app submits requests to. `Engine` is the whole interface: a batching engine can replace
`SerialEngine` (one worker thread, one request at a time, a bounded queue) without touching the app."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Protocol

from specdec.api import Chunk, Decoder, GenerationParams

_END = object()


class QueueFull(Exception):
    pass


class Job:
    """One request's output as it comes: `await job.next()` gives Chunks, then None; an exception raised
    while decoding is raised there. `cancel()` (the client left) stops its decoding at its next chunk."""

    def __init__(self, prompt, params: GenerationParams) -> None:
        self.prompt, self.params = prompt, params
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

    def close(self) -> None: ...


class SerialEngine:
    """Decodes one request at a time, in arrival order, on a worker thread; at most `max_queue` wait."""

    def __init__(self, decoder: Decoder, max_queue: int = 64) -> None:
        self.decoder = decoder
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running = 0
        self._thread = threading.Thread(target=self._work, name="specdec-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def waiting(self) -> int:
        return self._queue.qsize()

    def running(self) -> int:
        return self._running

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

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
                job.put(chunk)
                if job.cancelled:
                    break
        finally:
            stream.close()  # releases the decoder for the next request
