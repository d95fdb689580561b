"""A session on a tier as the coordinator holds it (coordinator.tiers.session.TierSession), over fake calls:
close() closes the session's stream, which ends the session on its replica (the replica drops a stream's
sessions when the stream ends: tests/test_lifecycle.py, tests/test_direct_rounds.py and
tests/test_metrics.py see them ended, with no EndSession rpc), whether or not anything was sent on it."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.stats import RoundStats
from coordinator.tiers.session import DRAFT_RETRY, TierSession
from specdec.core.prefix import PrefixHashes
from specdec.proto import draft_pb2


class FakeCalls:
    tier, session_id, timeout_s = "draft", "s", 5.0

    def __init__(self) -> None:
        self.sent, self.closed = 0, 0

    async def call(self, request, limit_s=None):
        self.sent += 1
        return draft_pb2.ProposeResponse(tokens=[7], cached_len=len(request.context.new_tokens))

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("requests", [0, 2])
def test_closing_a_session_closes_its_stream_once_and_sends_nothing(requests):
    calls = FakeCalls()
    session = TierSession(calls, DRAFT_RETRY, RoundStats())
    sequence = [1, 2, 3]

    async def go():
        for _ in range(requests):
            await session.call(sequence, PrefixHashes(sequence),
                               lambda ctx: draft_pb2.ProposeRequest(context=ctx, num_tokens=1),
                               extra=lambda r: list(r.tokens))
        await session.close()

    asyncio.run(go())
    assert (calls.sent, calls.closed) == (requests, 1)
