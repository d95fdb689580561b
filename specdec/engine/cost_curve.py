"""The step's cost curve, measured at start: how long one forward takes for B sessions with t new tokens each.

A tier's step time grows with the batch, and not along one line (flat while streaming the weights bounds it,
steep once arithmetic does), so what a draft token costs depends on the batch it joins: on a 2-core CPU a
verify of 5 tokens costs ~1.1x one of 1 at batch 1, and 16 sessions' drafts cost ~2.4 ms a token more. The
coordinator cannot learn that from sessions that have not run yet (a burst of clients starting together), so
each replica times a few forwards before serving, at the batch sizes and tokens per session it will see, and
reports them in its status (StatusResponse.cost_curve). Each forward runs B scratch sessions over a short
cached context. The points are taken coarse grid first (one session and a full batch, a decode step and a
verify of K = 3), so that a busy machine's budget still spans the batch sizes; the first MIN_POINTS always.

A tier often starts beside others on the same cores (`make run`, `specdec serve`: all three processes start
at once), and the first points then time the others' imports as much as this step: measured with the default
pair, a one-token step timed at 85 ms that takes 6, which priced every verify ~10x too dear and made drafting
look free (the default request at 0.56x K = 0). So the first MIN_POINTS are timed again last, keeping each
point's fastest, and the curve is made non-decreasing in tokens at each batch size (a step with more tokens
is never faster: a point slower than a larger one was timed on a busy machine and takes the larger's time).
"""

from __future__ import annotations

import time

from specdec.engine.runner import Feed

# (sessions, new tokens per session), in the order measured: the coarse grid first, then the points between.
GRID = [(1, 1), (16, 1), (1, 4), (16, 4)] + [(b, t) for t in (1, 4) for b in (4, 32)] + [
    (b, t) for t in (2, 8) for b in (1, 16, 4, 32)] + [(b, t) for t in (1, 4, 2, 8) for b in (2, 8)]
MIN_POINTS = 4  # measured whatever the budget: a decode step and a verify of K = 3, alone and in a batch of 16
CONTEXT = 4  # tokens each scratch session holds before the timed forwards
REPEATS = 2  # each point is the fastest of this many forwards
FEEDS = (16, 64)  # measure_feed's forwards: one session fed this many tokens, only the last one scored


def _time(runner, feeds: list[Feed]) -> float:
    """The fastest of REPEATS forwards of `feeds`, ms."""
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        runner.forward_checked(feeds)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(runner, cache, max_sessions: int, max_tokens: int, budget_s: float) -> list[tuple[int, int, float]]:
    """(sessions, tokens in all, ms) of forwards on `runner` over free slots of `cache`, at most max_sessions
    sessions and max_tokens tokens each, stopping once budget_s seconds are spent (0: none at all)."""
    if budget_s <= 0:
        return []
    slots: list[int] = []
    while len(slots) < min(max(b for b, _ in GRID), max_sessions) and (slot := cache.allocate()) is not None:
        slots.append(slot)
    points: list[tuple[int, int, float]] = []
    try:
        deadline = time.perf_counter() + budget_s
        runner.forward_checked([Feed(slot, 0, [0] * CONTEXT, 1) for slot in slots])  # the scratch sessions' context
        for b, t in ((b, t) for b, t in GRID if b <= len(slots) and b * t <= max_tokens):
            points.append((b, b * t, _time(runner, [Feed(slot, CONTEXT, [0] * t, t) for slot in slots[:b]])))
            if len(points) >= MIN_POINTS and time.perf_counter() > deadline:
                break
        for i, (b, n, ms) in enumerate(points[:MIN_POINTS]):  # again, now that the tiers beside it have started
            points[i] = (b, n, min(ms, _time(runner, [Feed(slot, CONTEXT, [0] * (n // b), n // b) for slot in slots[:b]])))
        return monotone(points)
    finally:
        for slot in slots:
            cache.release(slot)


def measure_feed(runner, cache, max_tokens: int) -> list[tuple[int, int, float]]:
    """(1, tokens, ms) of forwards feeding one session FEEDS tokens (at most max_tokens), only the last scored: what
    catching a session up costs (a prefill; a step's points above score every token, and a small model's LM head
    is most of its cost), which the coordinator prices a draft's return after rounds it sat out from."""
    slot = cache.allocate()
    if slot is None:
        return []
    try:
        return [(1, n, _time(runner, [Feed(slot, 0, [0] * n, 1)])) for n in FEEDS if n <= max_tokens]
    finally:
        cache.release(slot)


def monotone(points: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The points in their order, each no slower than any point of the same sessions with more tokens."""
    out = []
    for b, n, ms in points:
        larger = [m for b2, n2, m in points if b2 == b and n2 > n]
        out.append((b, n, min([ms, *larger])))
    return out
