"""The public gRPC API (specdec.v1.Generation): thin handlers over the Frontend's one generation path."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from coordinator.api.frontend import Frontend, deadline_from
from specdec.core.errors import RequestError
from specdec.proto import generate_pb2_grpc
from specdec.serving.server import handle_errors

SERVICE_NAME = "specdec.v1.Generation"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """The public gRPC API: thin handlers over the Frontend's one generation path."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        events = self.frontend.generate(request, deadline=deadline_from(context.time_remaining()), api="grpc")
        try:
            async with contextlib.aclosing(read_ahead(events)) as ahead:  # settled before events is closed below
                async for event in ahead:
                    yield event
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:
            await events.aclose()

    @handle_errors
    async def GetInfo(self, request, context):
        return self.frontend.info()


async def read_ahead(events: AsyncIterator) -> AsyncIterator:
    """The events, the next one computed while the caller writes this one: gRPC resumes a streaming handler
    only once its last message's write has completed (a hop through gRPC's completion-queue thread), so a
    round no longer waits for its predecessor's chunk to be written. At most one event is held ahead;
    cancelling the caller cancels the one being computed."""
    ahead = asyncio.ensure_future(anext(events))
    try:
        while True:
            try:
                event = await ahead
            except StopAsyncIteration:
                return
            ahead = asyncio.ensure_future(anext(events))
            yield event
    finally:
        if not ahead.done():
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)  # the generation settles before it is closed
