"""A queue's items as they come, until a future is done: the parts of an answer ahead of the answer itself (the
target's partial responses to a run-on in parts, and the coordinator's reading of them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


async def items_until(queue: asyncio.Queue, main: asyncio.Future) -> AsyncIterator[Any]:
    """Each item put on `queue`, in order, until `main` is done; what is queued after that is left (the caller then
    reads main's result, which holds it). The read in flight is cancelled however the iteration ends."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait((getter, main), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the iteration itself cancelled
            getter.cancel()
            raise
        if not getter.done():  # main is done first
            getter.cancel()
            return
        yield getter.result()
