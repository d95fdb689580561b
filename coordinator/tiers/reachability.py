"""Whether a tier has a replica the coordinator can reach, known before a request needs it.

A probe per tier asks the standard gRPC health service for the tier's service over the tier's own channel
(the channel every session uses: the same name resolution, ring hash and client-side health checks), every
`interval_s`. With no session header the ring hash starts at a random point of the ring and walks it to a
connected replica, so a check fails only when no replica is connected (or the one it lands on has just
turned NOT_SERVING). An outage counts once probes have failed `failures` times in a row over at least
`confirm_s`: a replica that has just come back is connected within the channel's reconnect back-off
(RoutingConfig.max_reconnect_backoff_s), and until then every check fails although it serves (measured: a
target restarted 0.6 s before the other one drained was still waiting out its back-off, and an outage
declared at once failed every session). One success makes the tier reachable again. A session that sees
its tier fail asks for a probe at once (suspect()), so an outage is known about `confirm_s` after the first
failed call. While sessions' calls to the tier succeed, the probe rests: a reply heard within the last
`interval_s` is proof enough (heard()), so a busy coordinator sends no health checks; a quiet one probes as
before, and a failed call still asks for a probe at once.

What follows from it (coordinator wiring): no reachable target replica = the coordinator's health is
NOT_SERVING (HTTP /health 503), new requests fail at once with UNAVAILABLE, and sessions waiting for the
target stop retrying; an unreachable draft tier only degrades (prompt lookup drafts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReachabilityConfig:
    """Reachability: how often and how patiently each tier is probed."""

    interval_s: float = 0.5  # between probes
    timeout_s: float = 2.0  # a probe's deadline (a replica busy with a long step still answers within it)
    failures: int = 2  # failed probes in a row before the tier counts as unreachable
    confirm_s: float = 1.0  # ... and for at least this long (longer than the tier channels' reconnect back-off)
    retry_s: float = 0.1  # between probes while they fail and the verdict still stands


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
        self._failures = 0  # failed probes in a row
        self._failing_since: float | None = None  # when the first of them ran (time.monotonic())
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._heard = float("-inf")  # time.monotonic() of the last reply a session had from the tier (heard())
        self.probes = 0  # health checks sent

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

    def heard(self) -> None:
        """A session's call to the tier just succeeded: until interval_s from now the probe need not ask."""
        self._heard = time.monotonic()

    def why(self) -> str:
        """For error messages: the tier and the last probe's failure."""
        return f"no {self.tier} replica is reachable" + (f" ({self.last_error})" if self.last_error else "")

    async def probe(self) -> bool:
        """One health check; updates the verdict; returns whether it succeeded."""
        self.probes += 1
        try:
            reply = await self._check(health_pb2.HealthCheckRequest(service=self.service), timeout=self.config.timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            error = "" if ok else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        except grpc.aio.AioRpcError as e:
            ok, error = False, f"{e.code().name}: {e.details()}"
        now = time.monotonic()
        if ok:
            self._failures, self._failing_since = 0, None
        else:
            self._failures += 1
            self._failing_since = now if self._failing_since is None else self._failing_since
        self.last_error = error
        confirmed = (self._failures >= self.config.failures
                     and now - self._failing_since >= self.config.confirm_s)
        self._set(ok or (self.reachable and not confirmed))
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
        suspected = False
        while True:
            self._wake.clear()
            # Sessions heard from the tier lately, nothing failed: their replies stand for this probe.
            quiet = time.monotonic() - self._heard >= self.config.interval_s
            if suspected or quiet or self._failures or not self.reachable:
                await self.probe()
            # While probes fail and the verdict still stands, probe again soon: an outage counts `confirm_s`
            # after the first failure, not `failures` intervals.
            wait = self.config.retry_s if self.reachable and self._failures else self.config.interval_s
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
                suspected = True
            except asyncio.TimeoutError:
                suspected = False
