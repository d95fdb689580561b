"""Generate's read-ahead (coordinator.api.grpc_api.read_ahead): the same events in the same order, at most one
computed ahead of the writer, and closing it cancels that one and lets the generation clean up. End to end it is
covered by every test through the gRPC API (greedy identity, cancellation freeing the sessions)."""

from __future__ import annotations

import asyncio
import contextlib

from coordinator.api.grpc_api import read_ahead


def test_events_come_in_order_with_at_most_one_ahead():
    produced: list[int] = []

    async def events():
        for i in range(5):
            produced.append(i)
            yield i

    async def run():
        got = []
        async with contextlib.aclosing(read_ahead(events())) as ahead:
            async for event in ahead:
                await asyncio.sleep(0)  # the write: the next event is computed meanwhile
                assert len(produced) <= event + 2  # this one, and at most the next
                got.append(event)
        return got

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_closing_cancels_the_event_being_computed_and_the_generation_cleans_up():
    async def run():
        done, blocked = asyncio.Event(), asyncio.Event()

        async def events():
            try:
                yield "first"
                blocked.set()
                await asyncio.sleep(3600)  # a round that never ends
                yield "never"
            finally:
                done.set()

        source = events()
        async with contextlib.aclosing(read_ahead(source)) as ahead:
            assert await anext(ahead) == "first"
            await blocked.wait()  # the next round is under way while "first" is written
        assert done.is_set()  # cancelled, and its finally ran, before read_ahead returned
        await source.aclose()  # as Generate does after: the generation is no longer running
        return True

    assert asyncio.run(run())
