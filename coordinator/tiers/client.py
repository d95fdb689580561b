"""Clients for the draft and target tiers (one channel each, to all of a tier's replicas) and one session's
stream on each (SessionStream: the draft's ProposeStream, the target's VerifyStream, both carrying the
session's routing key)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from coordinator.tiers.pushes import PushedProposals
from specdec.serving.routing import RoutingConfig
from specdec.core.errors import TIER_STATUS_METADATA
from specdec.proto import common_pb2, draft_pb2_grpc, target_pb2_grpc


class TierError(Exception):
    """An internal rpc failed; `code` is the tier's status (or DEADLINE_EXCEEDED on our timeout)."""

    def __init__(self, tier: str, code: grpc.StatusCode, details: str, rpc: str = "") -> None:
        super().__init__(f"{tier} service: {code.name}: {details}")
        self.tier = tier
        self.code = code
        self.details = details
        self.rpc = rpc or ("VerifyStream" if tier == "target" else "ProposeStream")  # the internal rpc that failed


def stream_status(code: grpc.StatusCode, details: str, trailing_metadata) -> tuple[grpc.StatusCode, str]:
    """A session stream's end as the coordinator acts on it. A status the replica chose carries
    TIER_STATUS_METADATA and stands. Without it the connection failed under the call (the replica died or
    shut down): gRPC core reports that as UNAVAILABLE, but at times as INTERNAL or UNKNOWN, which would
    read as the tier's verdict on the request and end the generation instead of retrying elsewhere."""
    from_tier = all(item in tuple(trailing_metadata or ()) for item in TIER_STATUS_METADATA)
    if from_tier or code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return code, details
    return grpc.StatusCode.UNAVAILABLE, f"connection lost ({code.name}: {details})"


def call_timeout(default_s: float, limit_s: float | None) -> float:
    """The per-call timeout: the configured one, capped by the time the request has left."""
    return default_s if limit_s is None else max(0.001, min(default_s, limit_s))


class SessionStream:
    """One session's bidirectional stream on one tier (the draft's ProposeStream, the target's
    VerifyStream). Opened with the session's routing metadata, it lives on the session's replica; the
    replica drops the session when the stream ends.

    Requests may be pipelined: send() a speculative request, then later recv() its reply; replies
    come back in request order. Each operation is bounded by the per-call timeout with a timer that
    cancels the stream (not a task per operation: this runs twice per round).
    """

    def __init__(self, tier: str, rpc: str, open_stream: Callable[..., grpc.aio.StreamStreamCall], session_id: str,
                 timeout_s: float, metadata) -> None:
        self.tier = tier
        self.rpc = rpc
        self._open = open_stream
        self.session_id = session_id
        self.timeout_s = timeout_s
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None
        self._expired: float | None = None  # the timeout that cancelled the stream, if one did
        self.pending = 0  # requests sent whose replies were not read yet
        self.pushes = PushedProposals()  # the draft's unasked proposals (ProposeResponse.pushed), as they arrive
        self._reading: asyncio.Task | None = None  # the read in flight, if one outlived its reader (pushes_until)
        self.on_part: Callable[[Any], None] | None = None  # given the parts of the reply awaited (VerifyResponse.partial)

    async def _io(self, call: grpc.aio.StreamStreamCall, awaitable, limit_s: float | None):
        """One stream operation under the per-call timeout; any failure closes the stream."""
        timeout = call_timeout(self.timeout_s, limit_s)
        timer = asyncio.get_running_loop().call_later(timeout, self._expire, call, timeout)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._expired is None or call is not self._call:
                raise  # our own caller was cancelled
            raise self._timed_out() from None
        except grpc.aio.AioRpcError as e:
            if self._expired is not None and call is self._call and e.code() == grpc.StatusCode.CANCELLED:
                raise self._timed_out() from None  # our timer cancelled it
            self.close()
            code, details = stream_status(e.code(), e.details() or "", e.trailing_metadata())
            raise TierError(self.tier, code, details, self.rpc) from None
        except asyncio.InvalidStateError:  # a write after the stream ended (drained, stopped, timed out): why?
            if self._expired is not None and call is self._call:
                raise self._timed_out() from None
            code, details = stream_status(await call.code(), await call.details(), await call.trailing_metadata())
            self.close()
            if code == grpc.StatusCode.OK:
                code = grpc.StatusCode.UNAVAILABLE
            raise TierError(self.tier, code, details or "the stream ended", self.rpc) from None
        finally:
            timer.cancel()

    def _timed_out(self) -> TierError:
        """The per-call timer cancelled the stream: DEADLINE_EXCEEDED, however grpc reported the cancel."""
        timeout = self._expired
        self.close()
        return TierError(self.tier, grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout:.3g}s", self.rpc)

    def _expire(self, call: grpc.aio.StreamStreamCall, timeout: float) -> None:
        if call is self._call:
            self._expired = timeout
            call.cancel()  # the pending operation raises CancelledError, turned into DEADLINE_EXCEEDED above

    async def send(self, request, limit_s: float | None = None) -> None:
        if self._call is None:
            self._call, self._expired = self._open(metadata=self._metadata), None
        await self._io(self._call, self._call.write(request), limit_s)
        self.pending += 1

    def _read(self, call: grpc.aio.StreamStreamCall) -> asyncio.Task:
        """The stream's next message: the read in flight if there is one, else a new one."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(call.read())
        return self._reading

    async def _next(self, call: grpc.aio.StreamStreamCall, limit_s: float | None):
        """The next message on the stream (EOF: the stream's end, raised as its status)."""
        reading = self._read(call)
        try:
            response = await self._io(call, asyncio.shield(reading), limit_s)
        finally:
            if reading.done():
                self._reading = None
        if response is grpc.aio.EOF:
            code, details = stream_status(await call.code(), await call.details(), await call.trailing_metadata())
            self.close()
            raise TierError(self.tier, code, details or "stream ended", self.rpc)
        return response

    async def recv(self, limit_s: float | None = None):
        call = self._call
        if call is None or self.pending == 0:
            raise TierError(self.tier, grpc.StatusCode.INTERNAL, f"no request in flight on the {self.rpc} stream", self.rpc)
        while (response := await self._next(call, limit_s)) is not None:
            if getattr(response, "pushed", False):
                self.pushes.add(response)  # filed for the round it holds for; the reply comes after it
            elif getattr(response, "partial", False):
                if self.on_part is not None:
                    self.on_part(response)
            else:
                break
        self.pending -= 1
        return response

    async def pushes_until(self, awaitable):
        """Await `awaitable` (the target's verdict), filing the pushes (and the replies nobody waits for) that
        arrive on this stream meanwhile. A failing stream is closed and costs no more than its pushes."""
        main = asyncio.ensure_future(awaitable)
        try:
            while self._call is not None and not main.done():
                call = self._call
                reading = self._read(call)
                await asyncio.wait((main, reading), return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    break  # the verdict: the read stays in flight for the next recv
                self._reading = None
                try:
                    response = reading.result()
                except (grpc.aio.AioRpcError, asyncio.CancelledError):
                    self.close()
                    break
                if response is grpc.aio.EOF:
                    self.close()
                elif response.pushed:
                    self.pushes.add(response)
                elif self.pending:
                    self.pending -= 1  # a reply to a request sent only to move the draft on (send_only)
            return await main
        finally:
            if not main.done():
                main.cancel()

    async def call(self, request, limit_s: float | None = None):
        """Drain replies nobody wants any more (their parts dropped), then one request / reply."""
        on_part, self.on_part = self.on_part, None
        try:
            while self.pending:
                await self.recv(limit_s)
        finally:
            self.on_part = on_part
        await self.send(request, limit_s)
        return await self.recv(limit_s)

    def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            call.cancel()
        if self._reading is not None:
            reading, self._reading = self._reading, None
            reading.cancel()
        self.pending = 0
        self.pushes.clear()


class TierClient:
    """One tier: one channel to all its replicas (coordinator.tiers.routing), and each session's stream on it."""

    def __init__(self, tier: str, stub, stream_rpc: str, address: str, timeout_s: float, routing: RoutingConfig) -> None:
        self.tier = tier
        self.address = address
        self.stub = stub
        self.stream_rpc = stream_rpc
        self.timeout_s = timeout_s
        self.routing = routing

    @classmethod
    def draft(cls, channel: grpc.aio.Channel, address: str, timeout_s: float, routing: RoutingConfig) -> "TierClient":
        """The draft tier; a session proposes on its ProposeStream."""
        return cls("draft", draft_pb2_grpc.DraftServiceStub(channel), "ProposeStream", address, timeout_s, routing)

    @classmethod
    def target(cls, channel: grpc.aio.Channel, address: str, timeout_s: float, routing: RoutingConfig) -> "TierClient":
        """The target tier; a session verifies on its VerifyStream."""
        return cls("target", target_pb2_grpc.TargetServiceStub(channel), "VerifyStream", address, timeout_s, routing)

    def session(self, session_id: str, routing_key: str | None = None) -> SessionStream:
        """The session's stream on the tier; routing_key: what it is hashed on (RoutingConfig.routing_key;
        default the session's id). Closing it ends the session on its replica."""
        return SessionStream(self.tier, self.stream_rpc, getattr(self.stub, self.stream_rpc), session_id, self.timeout_s,
                             self.routing.metadata(routing_key or session_id))

    async def model_info(self) -> common_pb2.ModelInfo:
        """From any one replica (no routing key: the balancer picks one)."""
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=self.timeout_s)

    async def status(self) -> common_pb2.StatusResponse:
        """From any one replica: its load, and the cost curve it measured at start."""
        return await self.stub.GetStatus(common_pb2.StatusRequest(), timeout=self.timeout_s)
