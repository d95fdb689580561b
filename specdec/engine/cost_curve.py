"""The step's cost curve, measured at start: how long one forward takes for B sessions with t new tokens each.

A tier's step time grows with the batch, and not along one line (flat while streaming the weights bounds it,
steep once arithmetic does), so what a draft token costs depends on the batch it joins: on a 2-core CPU a
verify of 5 tokens costs ~1.1x one of 1 at batch 1, and 16 sessions' drafts cost ~2.4 ms a token more. The
coordinator cannot learn that from sessions that have not run yet (a burst of clients starting together), so
each replica times a few forwards before serving, at the batch sizes and tokens per session it will see, and
reports them in its status (StatusResponse.cost_curve). Each forward runs B scratch sessions over a short
cached context; the points are taken smallest first within a time budget.
"""

from __future__ import annotations

import time

from specdec.engine.runner import Feed

SESSIONS = (1, 2, 4, 8, 16, 32)  # batch sizes timed (up to the engine's limits)
TOKENS = (1, 2, 4, 8)  # new tokens per session: a decode step, and verifies of K = 1, 3, 7
CONTEXT = 16  # tokens each scratch session holds before the timed forwards
REPEATS = 2  # each point is the fastest of this many forwards


def measure(runner, cache, max_sessions: int, max_tokens: int, budget_s: float) -> list[tuple[int, int, float]]:
    """(sessions, tokens in all, ms) of forwards on `runner` over free slots of `cache`, at most max_sessions
    sessions and max_tokens tokens each, stopping once budget_s seconds are spent (0: none)."""
    if budget_s <= 0:
        return []
    slots: list[int] = []
    while len(slots) < min(max(SESSIONS), max_sessions) and (slot := cache.allocate()) is not None:
        slots.append(slot)
    points: list[tuple[int, int, float]] = []
    try:
        deadline = time.perf_counter() + budget_s
        for s in range(0, len(slots), 8):  # the scratch sessions' context, a few sessions per forward
            runner.forward_checked([Feed(slot, 0, [0] * CONTEXT, 1) for slot in slots[s:s + 8]])
        for b in (b for b in SESSIONS if b <= len(slots)):
            for t in (t for t in TOKENS if b * t <= max_tokens):
                feeds = [Feed(slot, CONTEXT, [0] * t, t) for slot in slots[:b]]
                best = float("inf")
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    runner.forward_checked(feeds)
                    best = min(best, time.perf_counter() - t0)
                points.append((b, b * t, best * 1e3))
                if time.perf_counter() > deadline:
                    return points
        return points
    finally:
        for slot in slots:
            cache.release(slot)
