"""Whether a tier has a replica the coordinator can reach, known before a request needs it.

A probe per tier asks the standard gRPC health service for the tier's service over the tier's own channel
(the channel every session uses: the same name resolution, ring hash and client-side health checks), every
`interval_s`. With no session header the ring hash picks a random replica and passes over ones that are
down or NOT_SERVING, so a probe succeeds while any replica serves. `failures` failed probes in a row make
the tier unreachable; one success makes it reachable again. A session that sees its tier fail asks for a
probe at once (suspect()), so an outage is known within about a second of the first failed call.

What follows from it (coordinator wiring): no reachable target replica = the coordinator's health is
NOT_SERVING (HTTP /health 503), new requests fail at once with UNAVAILABLE, and sessions waiting for the
target stop retrying; an unreachable draft tier only degrades (prompt lookup drafts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReachabilityConfig:
    interval_s: float = 0.5  # between probes
    timeout_s: float = 2.0  # a probe's deadline (a replica busy with a long step still answers within it)
    failures: int = 2  # failed probes in a row before the tier counts as unreachable


class TierReachability:
    """The probe of one tier; `reachable` is its last verdict (True at start: the coordinator starts only
    once the tiers answered). on_change(reachable) is called, on the event loop, when the verdict flips."""

    def __init__(self, tier: str, channel: grpc.aio.Channel, service: str, config: ReachabilityConfig = ReachabilityConfig(),
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.tier = tier
        self.service = service
        self.config = config
        self.on_change = on_change
        self.reachable = True
        self.down = asyncio.Event()  # set while unreachable (retries wait on it)
        self.last_error = ""  # why the last probe failed ("" after a success)
        self._check = health_pb2_grpc.HealthStub(channel).Check
        self._failures = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def suspect(self) -> None:
        """A call to the tier failed as if it were down: probe now rather than at the next interval."""
        self._wake.set()

    def why(self) -> str:
        """For error messages: the tier and the last probe's failure."""
        return f"no {self.tier} replica is reachable" + (f" ({self.last_error})" if self.last_error else "")

    async def probe(self) -> bool:
        """One health check; updates the verdict; returns whether it succeeded."""
        try:
            reply = await self._check(health_pb2.HealthCheckRequest(service=self.service), timeout=self.config.timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            error = "" if ok else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        except grpc.aio.AioRpcError as e:
            ok, error = False, f"{e.code().name}: {e.details()}"
        self._failures = 0 if ok else self._failures + 1
        self.last_error = error
        self._set(ok or (self.reachable and self._failures < self.config.failures))
        return ok

    def _set(self, reachable: bool) -> None:
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if reachable:
            self.down.clear()
            log.info("%s tier reachable again", self.tier, extra={"tier": self.tier})
        else:
            self.down.set()
            log.warning("%s; probing every %.2gs", self.why(), self.config.interval_s, extra={"tier": self.tier})
        if self.on_change is not None:
            self.on_change(reachable)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            await self.probe()
            # Right after a failure that did not yet flip the verdict, probe again at once: an outage counts
            # after `failures` quick probes, not `failures` intervals.
            if self.reachable and self._failures:
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.interval_s)
