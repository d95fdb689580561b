"""Admission control: a cap on generations in flight and on the rate of new ones. A request over a
limit gets RESOURCE_EXHAUSTED at once (or after waiting at most max_queue_wait_s for a rate slot),
never an unbounded queue."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
from asyncio_throttle import Throttler

from specdec.core.errors import RequestError
from specdec.core.settings import setting


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission: concurrency and request-rate limits."""

    max_concurrency: int = 64  # generations in flight before RESOURCE_EXHAUSTED (0 = unlimited)
    max_requests_per_s: float = setting(0.0, flag="max-rps")  # new generations per second before RESOURCE_EXHAUSTED (0 = unlimited)
    max_queue_wait_s: float = setting(0.25, flag="admission-wait")  # longest wait for a rate slot, seconds


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.active = 0  # admitted generations, including those waiting for a rate slot
        self.waiting = 0  # of those, waiting for a rate slot
        self.rejected = 0
        rps = config.max_requests_per_s
        self._throttler = None
        if rps > 0:
            # asyncio-throttle counts whole requests per period: N per second, or 1 per 1/rps seconds.
            self._throttler = Throttler(rate_limit=int(rps), period=1.0) if rps >= 1 else Throttler(rate_limit=1, period=1.0 / rps)

    @property
    def running(self) -> int:
        """Generations admitted and past the rate limit: vLLM's num_requests_running."""
        return self.active - self.waiting

    @contextlib.asynccontextmanager
    async def admit(self):
        c = self.config
        if c.max_concurrency and self.active >= c.max_concurrency:
            self.rejected += 1
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: {self.active} generations in flight (max_concurrency={c.max_concurrency}); retry later")
        self.active += 1
        try:
            if self._throttler is not None:
                self.waiting += 1
                try:
                    await asyncio.wait_for(self._throttler.acquire(), c.max_queue_wait_s)
                except asyncio.TimeoutError:
                    self.rejected += 1
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"request rate above max_requests_per_s={c.max_requests_per_s}; retry later") from None
                finally:
                    self.waiting -= 1
            yield
        finally:
            self.active -= 1
