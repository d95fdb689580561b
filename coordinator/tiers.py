"""Clients for the draft and target tiers (one channel each, to all of a tier's replicas), one session's
calls on each (DraftStream, VerifyCalls, both carrying the session's routing key), and what the
coordinator knows of a tier's cache for a session (TierCursor)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from coordinator.routing import RoutingConfig
from specdec.wire.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class TierError(Exception):
    """An internal rpc failed; `code` is the tier's status (or DEADLINE_EXCEEDED on our timeout)."""

    def __init__(self, tier: str, code: grpc.StatusCode, details: str, rpc: str = "") -> None:
        super().__init__(f"{tier} service: {code.name}: {details}")
        self.tier = tier
        self.code = code
        self.details = details
        self.rpc = rpc or ("Verify" if tier == "target" else "ProposeStream")  # the internal rpc that failed


class TierCursor:
    """Which tokens one tier caches for a session, as far as the coordinator knows.

    The tier caches committed[:base] followed by `tail`: tokens it fed that were not known to be
    committed when sent (the draft's own proposals, the target's accepted drafts, a speculative
    context). Once rounds are committed, the leading tail tokens that match are reusable.
    """

    __slots__ = ("base", "tail", "_lost", "_on_reprefill")

    def __init__(self, on_reprefill: Callable[[], None] | None = None) -> None:
        """on_reprefill: called on the first reply after a reset() that dropped a cache, i.e. once the tier
        has the whole sequence again (a re-prefill: the tier had lost or was assumed to have lost it)."""
        self.base = 0
        self.tail: list[int] = []
        self._lost = False
        self._on_reprefill = on_reprefill

    def reset(self) -> None:
        self._lost = self._lost or self.base > 0 or bool(self.tail)
        self.base, self.tail = 0, []

    def context(self, session_id: str, sequence: list[int], hashes: PrefixHashes) -> common_pb2.SessionContext:
        """The context for a request over `sequence` (the committed tokens, or a hypothetical
        extension of them); `hashes` must cover `sequence`."""
        n = self.base
        for tok in self.tail:
            if n >= len(sequence) or sequence[n] != tok:
                break
            n += 1
        prefix = min(n, len(sequence) - 1)  # always send >= 1 token: the tier needs the last logits
        return common_pb2.SessionContext(
            session_id=session_id, prefix_len=prefix, prefix_hash=hashes.at(prefix), new_tokens=sequence[prefix:]
        )

    def update(self, ctx: common_pb2.SessionContext, extra: list[int], cached_len: int, committed_len: int) -> None:
        """Record a reply: the tier caches cached_len tokens of (context sequence + extra), of which
        only the first committed_len are known to be committed."""
        if self._lost and ctx.prefix_len == 0:
            self._lost = False
            if self._on_reprefill is not None:
                self._on_reprefill()
        self.base = min(cached_len, committed_len, ctx.prefix_len + len(ctx.new_tokens))
        after_prefix = list(ctx.new_tokens) + list(extra)
        self.tail = after_prefix[self.base - ctx.prefix_len : cached_len - ctx.prefix_len]


def call_timeout(default_s: float, limit_s: float | None) -> float:
    """The per-call timeout: the configured one, capped by the time the request has left."""
    return default_s if limit_s is None else max(0.001, min(default_s, limit_s))


def _tier_error(tier: str, e: grpc.aio.AioRpcError) -> TierError:
    return TierError(tier, e.code(), e.details() or "")


class DraftStream:
    """One session's bidirectional Propose stream. Opened with the session's routing metadata, it lives on
    the session's draft replica; the replica drops the session when the stream ends.

    Requests may be pipelined: send() a speculative request, then later recv() its reply; replies
    come back in request order.
    """

    tier = "draft"

    def __init__(self, client: "DraftClient", session_id: str) -> None:
        self._client = client
        self.session_id = session_id
        self.timeout_s = client.timeout_s
        self._metadata = client.routing.metadata(session_id)
        self._call = None
        self.pending = 0  # requests sent whose replies were not read yet

    async def _io(self, awaitable, limit_s: float | None):
        """One stream operation under the per-call timeout; any failure closes the stream."""
        timeout = call_timeout(self.timeout_s, limit_s)
        call = self._call
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except grpc.aio.AioRpcError as e:
            self.close()
            raise _tier_error("draft", e) from None
        except asyncio.InvalidStateError:  # a write after the replica ended the stream (drained, stopped): why?
            code, details = await call.code(), await call.details()
            self.close()
            if code == grpc.StatusCode.OK:
                code = grpc.StatusCode.UNAVAILABLE
            raise TierError("draft", code, details or "the stream ended") from None
        except asyncio.TimeoutError:
            self.close()
            raise TierError("draft", grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout:.3g}s") from None

    async def send(self, request: draft_pb2.ProposeRequest, limit_s: float | None = None) -> None:
        if self._call is None:
            self._call = self._client.stub.ProposeStream(metadata=self._metadata)
        await self._io(self._call.write(request), limit_s)
        self.pending += 1

    async def recv(self, limit_s: float | None = None) -> draft_pb2.ProposeResponse:
        call = self._call
        if call is None or self.pending == 0:
            raise TierError("draft", grpc.StatusCode.INTERNAL, "no request in flight on the draft stream")
        response = await self._io(call.read(), limit_s)
        if response is grpc.aio.EOF:
            code, details = await call.code(), await call.details()
            self.close()
            raise TierError("draft", code, details or "stream ended")
        self.pending -= 1
        return response

    async def call(self, request: draft_pb2.ProposeRequest, limit_s: float | None = None) -> draft_pb2.ProposeResponse:
        """Drain replies nobody wants any more, then one request / reply."""
        while self.pending:
            await self.recv(limit_s)
        await self.send(request, limit_s)
        return await self.recv(limit_s)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self.pending = 0

    async def end_session(self) -> None:
        """Close the stream and drop the session on its replica (best effort)."""
        self.close()
        await self._client.end_session(self.session_id)


class VerifyCalls:
    """One session's Verify calls, each carrying the session's routing metadata (so each reaches the
    replica that holds the session's cache)."""

    tier = "target"

    def __init__(self, client: "TargetClient", session_id: str) -> None:
        self._client = client
        self.session_id = session_id
        self.timeout_s = client.timeout_s
        self._metadata = client.routing.metadata(session_id)

    async def call(self, request: target_pb2.VerifyRequest, limit_s: float | None = None) -> target_pb2.VerifyResponse:
        try:
            return await self._client.stub.Verify(request, timeout=call_timeout(self.timeout_s, limit_s),
                                                  metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _tier_error("target", e) from None

    def close(self) -> None:
        """Nothing stays open between unary calls."""

    async def end_session(self) -> None:
        """Drop the session on its replica (best effort)."""
        await self._client.end_session(self.session_id)


class DraftClient:
    """The draft tier: one channel to all its replicas (coordinator.routing)."""

    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float, routing: RoutingConfig) -> None:
        self.address = address
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        self.timeout_s = timeout_s
        self.routing = routing

    def session(self, session_id: str) -> DraftStream:
        return DraftStream(self, session_id)

    async def end_session(self, session_id: str) -> None:
        try:
            await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=self.timeout_s,
                                       metadata=self.routing.metadata(session_id))
        except grpc.aio.AioRpcError:
            pass  # best effort: the replica may be gone, or may have evicted the session already

    async def model_info(self) -> common_pb2.ModelInfo:
        """From any one replica (no routing key: the balancer picks one)."""
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=self.timeout_s)


class TargetClient:
    """The target tier: one channel to all its replicas (coordinator.routing)."""

    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float, routing: RoutingConfig) -> None:
        self.address = address
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        self.timeout_s = timeout_s
        self.routing = routing

    def session(self, session_id: str) -> VerifyCalls:
        return VerifyCalls(self, session_id)

    async def end_session(self, session_id: str) -> None:
        try:
            await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=self.timeout_s,
                                       metadata=self.routing.metadata(session_id))
        except grpc.aio.AioRpcError:
            pass  # best effort: the replica may be gone, or may have evicted the session already

    async def model_info(self) -> common_pb2.ModelInfo:
        """From any one replica (no routing key: the balancer picks one)."""
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=self.timeout_s)
