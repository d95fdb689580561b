"""What the coordinator's own time costs a round: its CPU per tier call, in series with every round and,
under load, a floor under all of them (docs/DESIGN.md, Choosing the proposer and K).

One event loop serves every session's rounds; c, its CPU per tier call, is the loop thread's CPU time over
the calls its tiers answered (sampled a few times a second). A round of m calls (a draft-model round: m = 2)
spends m c in series with the tiers, and with L generations in flight none is shorter than L m c.
"""

from __future__ import annotations


class CoordinatorCost:
    """The coordinator's CPU per tier call (c, ms), from running totals of its loop's CPU and its calls."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.call_ms = 0.0  # c: nothing is charged until a sample measured it
        self.samples = 0
        self._anchor: tuple[float, int] | None = None  # (CPU seconds, calls) at the last sample with calls

    def sample(self, cpu_s: float, calls: int) -> None:
        """The loop thread's CPU time (seconds) and the tier calls answered, both running totals."""
        if self._anchor is not None and calls > self._anchor[1]:
            per_call = max(cpu_s - self._anchor[0], 0.0) * 1e3 / (calls - self._anchor[1])
            d = self.decay if self.samples else 0.0
            self.call_ms = d * self.call_ms + (1 - d) * per_call
            self.samples += 1
        # re-anchored every sample: with no calls since, the idle loop's CPU (health checks, probes) is not
        # charged to the next calls
        self._anchor = (cpu_s, calls)


def round_ms(tier_ms: float, calls: int, call_ms: float, in_flight: float) -> float:
    """A round the tiers price at tier_ms that makes `calls` tier calls, the coordinator's CPU per call being
    call_ms, with `in_flight` generations running on it: the loop's share in series, or the floor its whole
    load sets."""
    own = calls * call_ms
    return max(tier_ms + own, max(in_flight, 1.0) * own)
