"""Clients for the draft and target tiers, and what the coordinator knows of their caches."""

from __future__ import annotations

import asyncio

import grpc

from specdec.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class TierError(Exception):
    """An internal rpc failed; `code` is the tier's status (or DEADLINE_EXCEEDED on our timeout)."""

    def __init__(self, tier: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{tier} service: {code.name}: {details}")
        self.tier = tier
        self.code = code
        self.details = details


class TierCursor:
    """Which committed tokens one tier caches for a session, as far as the coordinator knows.

    After a request the tier caches committed[:valid] plus `spec`: tokens it fed that were not yet
    committed when sent (the draft's own proposals, the target's accepted drafts). Once the round is
    committed, the leading spec tokens that match the committed sequence are reusable.
    """

    __slots__ = ("valid", "spec")

    def __init__(self) -> None:
        self.valid = 0
        self.spec: list[int] = []

    def reset(self) -> None:
        self.valid, self.spec = 0, []

    def context(self, session_id: str, committed: list[int], hashes: PrefixHashes) -> common_pb2.SessionContext:
        n = self.valid
        for tok in self.spec:
            if n >= len(committed) or committed[n] != tok:
                break
            n += 1
        prefix = min(n, len(committed) - 1)  # always send >= 1 token: the tier needs the last logits
        return common_pb2.SessionContext(
            session_id=session_id, prefix_len=prefix, prefix_hash=hashes.at(prefix), new_tokens=committed[prefix:]
        )

    def update(self, ctx: common_pb2.SessionContext, extra: list[int], cached_len: int) -> None:
        """Record a reply: the tier caches cached_len tokens of committed[:sent] + extra."""
        sent = ctx.prefix_len + len(ctx.new_tokens)
        self.valid = min(cached_len, sent)
        self.spec = extra[: max(0, cached_len - sent)]


def _tier_error(tier: str, e: grpc.aio.AioRpcError) -> TierError:
    return TierError(tier, e.code(), e.details() or "")


class DraftStream:
    """One session's bidirectional Propose stream (pins the session to one draft replica)."""

    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._call = None

    async def propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        if self._call is None:
            self._call = self._stub.ProposeStream()
        call = self._call
        try:
            await asyncio.wait_for(call.write(request), self._timeout_s)
            response = await asyncio.wait_for(call.read(), self._timeout_s)
        except grpc.aio.AioRpcError as e:
            self._call = None
            raise _tier_error("draft", e) from None
        except asyncio.TimeoutError:
            self.close()
            raise TierError("draft", grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {self._timeout_s}s") from None
        if response is grpc.aio.EOF:
            self._call = None
            raise TierError("draft", await call.code(), await call.details() or "stream ended")
        return response

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class DraftClient:
    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
        self.address = address
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        self.timeout_s = timeout_s

    def stream(self) -> DraftStream:
        return DraftStream(self.stub, self.timeout_s)

    async def end_session(self, session_id: str) -> None:
        await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=self.timeout_s)

    async def model_info(self) -> common_pb2.ModelInfo:
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=self.timeout_s)


class TargetClient:
    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
        self.address = address
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        self.timeout_s = timeout_s

    async def verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        try:
            return await self.stub.Verify(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _tier_error("target", e) from None

    async def end_session(self, session_id: str) -> None:
        await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=self.timeout_s)

    async def model_info(self) -> common_pb2.ModelInfo:
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=self.timeout_s)
