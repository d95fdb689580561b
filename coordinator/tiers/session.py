"""One session's handle on one tier, the same class for the draft and the target: the session id, what the
tier caches of it (TierCursor), the session's calls (routed by its id to one replica, coordinator.tiers.routing),
and what to do when a call fails. Failure handling lives here and only here:

- The replica lacks the session (FAILED_PRECONDITION on a request that assumed a cached prefix: evicted,
  restarted, or the session moved to another replica because its own died or drained): resend the whole
  committed sequence at once (a re-prefill). A full resend also carries the coordinator's tokenizer
  fingerprint, so every replica is checked the first time it serves a session.
- The tier is unreachable or stalled (UNAVAILABLE, DEADLINE_EXCEEDED): per the tier's RetryPolicy, retry
  with back-off until the client's deadline (the target: nothing can go on without it), or give up at
  once and leave the tier alone for a back-off (the draft: prompt lookup stands in meanwhile). Retries
  end at once when the tier's probe (coordinator.tiers.reachability) finds no replica left: another
  replica takes a session over, a tier with none cannot, and the client hears so within a second.
- The client's own deadline runs out: say so; the tier is not to blame.
- Anything else (INVALID_ARGUMENT, a replica that refuses the session, ...): raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from coordinator.stats import RoundStats
from coordinator.tiers.client import TierError
from coordinator.tiers.cursor import TierCursor
from coordinator.tiers.reachability import TierReachability
from specdec.proto import common_pb2
from specdec.core.prefix import PrefixHashes

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class RetryPolicy:
    """What a session does when its tier is unreachable (a lost session is always re-prefilled at once)."""

    retry: bool = False  # retry an unreachable tier (False: give up at once)
    retry_s: float = 30.0  # when retrying: until the client's deadline, or this long without one
    first_retry_s: float = 0.05  # first delay between retries; doubled each time
    max_retry_s: float = 1.0  # longest delay between retries
    down_s: tuple[float, ...] = ()  # after giving up, leave the tier alone this long (by consecutive failures)


TARGET_RETRY = RetryPolicy(retry=True)  # the target: wait for it (retry_s comes from --tier-retry-timeout)
DRAFT_RETRY = RetryPolicy(down_s=(0.25, 0.5, 1.0))  # the draft: fall back to prompt lookup, try it again soon


def deadline_clock(deadline: float | None) -> Callable[[], float | None]:
    """time_left for a TierSession: seconds until a time.monotonic() deadline (None: none), keeping a margin
    to report an error in time."""

    def time_left() -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        return left - min(0.5, 0.1 * max(left, 0.0))

    return time_left


class SessionCalls(Protocol):
    """One session's rpcs on one tier (coordinator.tiers.client.SessionStream: the session's stream)."""

    tier: str  # "draft" or "target"
    session_id: str  # the session the calls belong to (and are routed by)
    timeout_s: float  # per-call deadline

    async def call(self, request: Any, limit_s: float | None = None) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TierReply:
    message: Any  # the tier's response
    wall_ms: float  # the successful call's round trip
    fed: int = 0  # tokens the tier had to feed: context.new_tokens less those its prefix cache supplied


class TierSession:
    def __init__(self, calls: SessionCalls, policy: RetryPolicy, stats: RoundStats, tokenizer_fingerprint: str = "",
                 time_left: Callable[[], float | None] = lambda: None,
                 reachability: TierReachability | None = None) -> None:
        """stats: the generation's counters (tier errors, re-prefills). time_left: seconds until the client's
        deadline, margin included (None: no deadline). reachability: the tier's probe, told of failed calls
        and asked before each retry (None: retry per the policy alone)."""
        self.reachability = reachability
        self.calls = calls
        self.tier = calls.tier
        self.session_id = calls.session_id
        self.policy = policy
        self.stats = stats
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.time_left = time_left
        self.cursor = TierCursor(on_reprefill=lambda: stats.reprefills.update((self.tier,)))
        self._failures = 0  # consecutive give-ups (the down back-off grows with them)
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        """False while the tier is left alone after a failure (RetryPolicy.down_s), or while its probe finds
        no replica."""
        reachable = self.reachability is None or self.reachability.reachable
        return reachable and time.monotonic() >= self._down_until

    @property
    def cached(self) -> int:
        """The committed tokens the tier caches for the session, as far as the coordinator knows."""
        return self.cursor.base

    def context(self, sequence: list[int], hashes: PrefixHashes) -> common_pb2.SessionContext:
        """The SessionContext of a request over `sequence` (committed, or a hypothetical extension)."""
        ctx = self.cursor.context(self.session_id, sequence, hashes)
        if ctx.prefix_len == 0:  # a first or full send: the replica checks that it has our tokenizer
            ctx.tokenizer_fingerprint = self.tokenizer_fingerprint
        return ctx

    async def call(self, sequence: list[int], hashes: PrefixHashes, request: Callable[[common_pb2.SessionContext], Any],
                   extra: Callable[[Any], list[int]], committed_len: int | None = None) -> TierReply:
        """One request over `sequence` (request(ctx) builds it), with the failure handling above. On success
        the cursor records what the tier now caches: the context's tokens plus extra(response) (the
        target's accepted drafts, the draft's proposals), of which committed_len are committed."""
        committed_len = len(sequence) if committed_len is None else committed_len
        backoff, give_up_at, last_error = self.policy.first_retry_s, None, None
        while True:
            ctx = self.context(sequence, hashes)
            left = self.time_left()
            if left is not None and left <= 0:
                code = last_error.code if last_error else grpc.StatusCode.DEADLINE_EXCEEDED
                raise TierError(self.tier, code, f"no answer before the request's deadline; last error: {last_error or 'none'}")
            t0 = time.perf_counter()
            try:
                response = await self.calls.call(request(ctx), left)
            except TierError as e:
                self.stats.observe_tier_error(e)
                self.cursor.reset()
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and ctx.prefix_len > 0:
                    continue  # the replica lacks the session: resend it all
                if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and left is not None and left < self.calls.timeout_s:
                    # The client's own deadline ran out, not the tier's: say so, and do not retry.
                    raise TierError(self.tier, e.code, "the request's deadline passed during the call") from None
                if e.code in RETRYABLE and self.reachability is not None:
                    self.reachability.suspect()  # probe now: is any replica left?
                if e.code not in RETRYABLE or not self.policy.retry:
                    self.mark_down(e)
                    raise
                # Unreachable, restarting or stalled: it may come back (or another replica take over)
                # without our session.
                last_error = e
                if self.reachability is not None and not self.reachability.reachable:
                    raise TierError(self.tier, grpc.StatusCode.UNAVAILABLE, self.reachability.why()) from None
                now = time.monotonic()
                if give_up_at is None:
                    give_up_at = now + self.policy.retry_s if left is None else float("inf")
                left = self.time_left()
                if now >= give_up_at or (left is not None and left <= backoff):
                    raise TierError(self.tier, grpc.StatusCode.UNAVAILABLE,
                                    f"unreachable, gave up retrying: {e.details}") from None
                await self._pause(backoff)
                backoff = min(backoff * 2, self.policy.max_retry_s)
                continue
            self._failures = 0
            if self.reachability is not None:
                self.reachability.heard()  # (the probe rests while calls succeed)
            wall_ms = (time.perf_counter() - t0) * 1e3
            self.stats.trace.observe(self.tier, t0, wall_ms, getattr(response, "trace", None))
            self.cursor.update(ctx, extra(response), response.cached_len, committed_len=committed_len)
            # the tier's prefix cache (or the draft's kept tree entries: salvaged) supplied the rest
            fed = len(ctx.new_tokens) - getattr(response, "prefix_reused", 0) - getattr(response, "salvaged", 0)
            return TierReply(response, wall_ms, fed)

    def pushed(self, sequence: list[int], hashes: PrefixHashes) -> Any | None:
        """The tier's pushed proposal for exactly this committed sequence, if it came (every other is dropped)."""
        return self.calls.pushes.take(len(sequence), hashes.at(len(sequence)))

    async def send_only(self, sequence: list[int], hashes: PrefixHashes, request: Callable[[common_pb2.SessionContext], Any]) -> None:
        """Send a request whose reply nobody waits for (the one that moves the draft on to a pushed proposal:
        its reply repeats the push). The cursor records what a tree request's reply says: the committed
        sequence, nothing past it. A failure closes the stream; the next call() recovers as for any failure."""
        ctx = self.context(sequence, hashes)
        try:
            await self.calls.send(request(ctx), self.time_left())
        except TierError as e:
            self.stats.observe_tier_error(e)
            self.cursor.reset()
            return
        self.cursor.update(ctx, [], len(sequence), committed_len=len(sequence))

    async def pushes_until(self, awaitable):
        """Await `awaitable`, filing the pushes that arrive on the session's stream meanwhile."""
        return await self.calls.pushes_until(awaitable)

    async def _pause(self, seconds: float) -> None:
        """A retry's back-off, cut short when the tier's probe finds no replica left."""
        if self.reachability is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.reachability.down.wait(), seconds)

    def mark_down(self, e: TierError) -> None:
        """After a failure the session gives up on: leave the tier alone for the policy's back-off."""
        self.calls.close()
        if not self.policy.down_s:
            return
        delay = self.policy.down_s[min(self._failures, len(self.policy.down_s) - 1)]
        self._failures += 1
        self._down_until = time.monotonic() + delay
        level = logging.ERROR if e.code == grpc.StatusCode.FAILED_PRECONDITION else logging.WARNING  # a refusing replica
        log.log(level, "session %s: %s tier unavailable (%s); not asked for %.2fs", self.session_id, self.tier, e, delay,
                extra={"session_id": self.session_id, "tier": self.tier, "code": e.code.name, "backoff_s": delay})

    async def close(self) -> None:
        """End the session on its replica: close its stream, with which the replica drops every session the stream
        served (specdec.serving.tier.serve_session_stream); a Drive's sessions end with the Drive. No rpc: a
        finished request costs neither the coordinator nor the tier a call (docs/DESIGN.md, Sessions and KV
        memory)."""
        self.calls.close()
