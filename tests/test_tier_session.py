"""A session on a tier as the coordinator holds it (coordinator.tiers.session.TierSession), over fake calls:
close() ends the session on the replica only if the replica may hold it (a request went out, or a Drive took
it: tests/test_direct_rounds.py and tests/test_lifecycle.py see those sessions ended). A default request's draft tier that the policy never asked is sent nothing at all, not even an
EndSession (a unary rpc, and the replica's work, per finished request)."""

from __future__ import annotations

import asyncio

from coordinator.stats import RoundStats
from coordinator.tiers.session import DRAFT_RETRY, TierSession
from specdec.core.prefix import PrefixHashes
from specdec.proto import draft_pb2


class FakeCalls:
    tier, session_id, timeout_s = "draft", "s", 5.0

    def __init__(self) -> None:
        self.sent, self.closed, self.ended = 0, 0, 0

    async def call(self, request, limit_s=None):
        self.sent += 1
        return draft_pb2.ProposeResponse(tokens=[7], cached_len=len(request.context.new_tokens))

    def close(self) -> None:
        self.closed += 1

    async def end_session(self) -> None:
        self.ended += 1


def test_a_session_never_sent_anything_is_not_ended_on_the_replica():
    calls = FakeCalls()
    session = TierSession(calls, DRAFT_RETRY, RoundStats())
    asyncio.run(session.close())
    assert (calls.sent, calls.ended, calls.closed) == (0, 0, 1)


def test_a_session_that_sent_a_request_is_ended_on_the_replica():
    calls = FakeCalls()
    session = TierSession(calls, DRAFT_RETRY, RoundStats())
    sequence = [1, 2, 3]

    async def go():
        await session.call(sequence, PrefixHashes(sequence), lambda ctx: draft_pb2.ProposeRequest(context=ctx, num_tokens=1),
                           extra=lambda r: list(r.tokens))
        await session.close()

    asyncio.run(go())
    assert (calls.sent, calls.ended) == (1, 1)

