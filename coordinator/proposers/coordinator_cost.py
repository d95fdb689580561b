"""What the coordinator's own time costs a round: its CPU per tier call, in series with every round and,
under load, a floor under all of them.

The coordinator serves every session's rounds on one event loop, and each tier call costs that loop CPU:
the rpc's send and receive through grpc.aio, the round's bookkeeping, streaming and detokenising what it
commits, the metrics. c, the loop's CPU per call, is measured as the loop thread's CPU time over the calls
its tiers answered (an exponentially weighted mean over samples a few times a second; idle time with no
calls is not charged). A round of m calls (a draft-model round: Propose and Verify, m = 2; K = 0 or a
local chain: m = 1) spends m c of it in series with the tiers, and with L generations in flight no round
is shorter than L m c: the loop is busy that long serving one round of each. On a CPU, where a step takes
tens of milliseconds, both are small beside the tiers' price and change no choice; where a batched step
costs ~1.5 ms and 32 generations are in flight (a GPU) the floor is the round's time, and a draft-model
round costs twice a K = 0 one. Measured on an H100 with the real pair before this was priced: the default
request at 0.40x K = 0 with 32 clients, its policy drafting (mean K 2.37) on the tiers' prices alone
(docs/performance.md, On a GPU).
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
