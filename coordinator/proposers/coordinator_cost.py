"""The coordinator's own time in a round's price: c, its event loop's CPU per tier call, is in series with every
round of m calls and, with L generations in flight, a floor L m c under each (docs/DESIGN.md, Choosing the
proposer and K)."""

from __future__ import annotations


class CoordinatorCost:
    """c (ms): the loop thread's CPU over the tier calls it answered, from running totals sampled a few times a
    second, exponentially weighted."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.call_ms = 0.0  # nothing is charged until a sample measured it
        self.samples = 0
        self._anchor: tuple[float, int] | None = None  # (CPU seconds, calls) at the last sample

    def sample(self, cpu_s: float, calls: int) -> None:
        """The loop thread's CPU time (seconds) and the tier calls answered, both running totals. Re-anchored
        every sample, so the idle loop's CPU (health checks, probes) is not charged to the next calls."""
        if self._anchor is not None and calls > self._anchor[1]:
            per_call = max(cpu_s - self._anchor[0], 0.0) * 1e3 / (calls - self._anchor[1])
            d = self.decay if self.samples else 0.0
            self.call_ms = d * self.call_ms + (1 - d) * per_call
            self.samples += 1
        self._anchor = (cpu_s, calls)


def round_ms(tier_ms: float, calls: int, call_ms: float, in_flight: float) -> float:
    """A round the tiers price at tier_ms making `calls` tier calls: max(T + m c, L m c)."""
    own = calls * call_ms
    return max(tier_ms + own, max(in_flight, 1.0) * own)
