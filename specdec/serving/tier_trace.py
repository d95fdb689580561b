"""The tier's part of the round trace: where one request's time went inside the replica (TierTrace in
common.proto), measured around the servicer's three steps (decode the request into a work, the engine's
answer, encode the response) and from the work's own timestamps (submitted, first step, answered).
Durations only, each on this process's clock, so no clocks need to agree across processes; the
coordinator lays them inside its round trip (coordinator.trace)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from specdec.proto import common_pb2


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


async def traced(request: Any, to_work: Callable[[Any], Any], submit: Callable[[Any], Awaitable[Any]],
                 to_response: Callable[[Any], Any]) -> Any:
    """to_response(await submit(to_work(request))), its response carrying the request's TierTrace."""
    t0 = time.perf_counter()
    work = to_work(request)
    t1 = time.perf_counter()
    result = await submit(work)
    t2 = time.perf_counter()
    response = to_response(result)
    t3 = time.perf_counter()
    settled = work.settled_at or t2
    stepped = work.first_step_at or settled  # answered with no step: all of it was the queue
    response.trace.CopyFrom(common_pb2.TierTrace(
        decode_us=_us(t1 - t0), queue_us=_us(stepped - work.submitted_at), step_us=_us(settled - stepped),
        wake_us=_us(t2 - settled), encode_us=_us(t3 - t2)))
    return response
