"""What every tier engine shares (Engine for a model, HeadEngine for an EAGLE-3 head): one engine thread that
runs the steps, fed from the event loop through an inbox under one lock, each work's answer a future on the
loop that submitted it. An engine may also let the submitting thread run a step itself (inline), where
handing it to the engine thread and the answer back would cost more than the step (Engine: a lone session's
small step on a one-thread CPU tier)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from specdec.core.errors import RequestError
from specdec.engine.work import Work

PUSH = object()  # in place of an error: a hand-back of unasked results (Engine.push), not an answer
Answer = tuple[Work, object, object]  # (work, result, error | PUSH)
INLINE_TOKENS = 16  # the most tokens an inline step may feed (a decode, a verify, a proposal's catch-up)


@dataclass(frozen=True)
class EngineStatus:
    num_sessions: int  # sessions holding a KV slot
    cached_tokens: int  # tokens in their caches (not counting the prefix cache's retained slots)
    evictions: int  # sessions evicted so far (LRU, idle TTL, token budget)
    num_running: int  # requests being computed
    num_waiting: int  # requests queued
    kv_used_bytes: int  # cached_tokens in bytes
    kv_capacity_bytes: int  # all slots, in bytes
    kv_capacity_tokens: int
    kv_resident_bytes: int  # memory the KV pool occupies now (CPU: positions ever written; GPU: all of it)
    step_mode: str  # eager | compile | cuda-graphs
    compile_s: float  # seconds spent compiling / capturing
    steps: int  # forwards run so far
    step_tokens: int  # tokens fed in them
    prefix_cache_sessions: int = 0  # retained slots of ended sessions (prefix-cache donors, evictable)
    prefix_cache_tokens: int = 0  # tokens in them
    prefix_cache_queries: int = 0  # tokens of fresh starts looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, tokens taken from it instead of prefilled
    inline_steps: int = 0  # steps (a head: proposals) run on a submitter's thread (StepConfig.inline_steps)


class EngineThread:
    """Subclasses run their step loop in _run() (waiting on _wake for the inbox, and starting no step while
    _paused) and may count queued works beyond the inbox (_queued), note each submission under the lock
    (_submitted), and hand a step to the submitting thread (_take_inline, never while _paused)."""

    def __init__(self, max_queue: int, name: str = "engine") -> None:
        self._max_queue = max_queue
        self._lock = threading.Lock()  # guards the inbox and the subclass's session table and queues
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Work] = []
        self._stopping = False
        self._paused = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No new step starts inside this block (the one running finishes); requests keep queueing."""
        with self._wake:
            self._paused = True
        try:
            yield
        finally:
            with self._wake:
                self._paused = False
                self._wake.notify()

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
            inline = self._take_inline(work)
            if inline is None:
                self._wake.notify()
        if inline is not None:
            inline()  # the answer is set here, unless the work needs more steps than this one
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

    def _take_inline(self, work: Work) -> Callable[[], None] | None:
        """Under the lock, with `work` just queued: a step taken from the engine thread's queue for the submitting
        thread to run itself, after the lock (None: the engine thread runs it, the default)."""
        return None

    def _run(self) -> None:
        raise NotImplementedError


def inline_steps_on(setting: str, device) -> bool:
    """StepConfig.inline_steps: on, off, or auto, on for a CPU tier computing on one torch thread (with more, the
    submitting thread's own OpenMP team beside the engine thread's would slow every step: specdec.engine.threads)."""
    return setting == "on" or (setting == "auto" and device.type == "cpu" and torch.get_num_threads() == 1)


def hand_back(answers: list[Answer]) -> None:
    """Answers to their event loops: delivered at once where this thread runs that loop (an inline step), else
    with one call_soon_threadsafe (one wake-up) per loop; a loop that has closed is skipped (nobody waits there)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Answer]] = {}
    for answer in answers:
        by_loop.setdefault(answer[0].loop, []).append(answer)
    here = asyncio._get_running_loop()
    for loop, items in by_loop.items():
        if loop is here:
            deliver_answers(items)
        else:
            try:
                loop.call_soon_threadsafe(deliver_answers, items)
            except RuntimeError:  # the loop is closed
                pass


def deliver_answers(answers: list[Answer]) -> None:
    """On the event loop: resolve the answered works' futures (a caller that went away is skipped)."""
    for work, result, error in answers:
        if error is PUSH:
            work.on_push(result)
            continue
        if work.future.done():
            continue
        if error is not None:
            work.future.set_exception(error)
        else:
            work.future.set_result(result)
