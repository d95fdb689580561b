"""What every tier engine shares (Engine for a model, HeadEngine for an EAGLE-3 head): one engine thread that
runs the steps, fed from the event loop through an inbox under one lock, each work's answer a future on the
loop that submitted it."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from specdec.core.errors import RequestError
from specdec.engine.work import Work


class EngineThread:
    """Subclasses run their step loop in _run() (waiting on _wake for the inbox) and may count queued works
    beyond the inbox (_queued) or note each submission under the lock (_submitted)."""

    def __init__(self, max_queue: int, name: str = "engine") -> None:
        self._max_queue = max_queue
        self._lock = threading.Lock()  # guards the inbox and the subclass's session table and queues
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Work] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    async def submit(self, work: Work):
        """Queue a work and await its result (RequestError on its own failure)."""
        loop = asyncio.get_running_loop()
        work.loop, work.future = loop, loop.create_future()
        work.submitted_at = time.perf_counter()
        with self._wake:
            if self._stopping:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
            if self._queued() >= self._max_queue:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{self._max_queue} requests already waiting; try again later")
            self._inbox.append(work)
            self._submitted(work)
            self._wake.notify()
        try:
            return await work.future
        except asyncio.CancelledError:
            work.cancelled = True  # the engine drops it at its next look
            raise

    def _queued(self) -> int:
        """Works waiting (under the lock)."""
        return len(self._inbox)

    def _submitted(self, work: Work) -> None:
        """A work just queued (under the lock)."""

    def _run(self) -> None:
        raise NotImplementedError
