"""Adaptive K: choose the number of draft tokens per round that maximises expected tokens per second.

With per-token acceptance a, a round with K drafts commits (1 - a^(K+1)) / (1 - a) tokens on average
(bonus included) and costs propose(K) + verify(K) + overhead. The propose cost is modelled as linear
in K and fitted online from the session's own rounds (exponentially weighted least squares), and a is
an exponentially weighted acceptance estimate. K = 0 (target-only) is a candidate too; when it wins, a
small K is still probed now and then so the estimates can recover.

The verify cost knows the load. The target batches many sessions into one step, whose time grows
with the tokens in it: T_step(n) = alpha + beta * n, fitted over every session's Verify responses
(each reports its step's tokens and time), shared by all sessions of the coordinator (TierLoad). With
B sessions per step, all choosing K, a round costs T_step(B * (K + 1)) plus the call's overhead, so
the rate maximised is the aggregate one: each extra draft token costs beta * B, and K falls as the
batch grows (vLLM switches speculation off above a fixed batch size; this measures where). With no
load data yet, the session's own linear fit of verify wall time is used.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per round, bonus included, for per-token acceptance a and K drafts."""
    if a >= 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class LinearCost:
    """Exponentially weighted least-squares fit of cost(K) = intercept + slope * K."""

    def __init__(self, decay: float, prior_intercept: float, prior_slope: float, prior_weight: float = 0.5) -> None:
        self.decay = decay
        # Prior pseudo-observations at K = 1 and K = 4 pin the line until real data spreads over K.
        self._s = [0.0] * 5  # sum w, sum wx, sum wy, sum wxx, sum wxy
        for x in (1.0, 4.0):
            self._add(x, prior_intercept + prior_slope * x, prior_weight)

    def _add(self, x: float, y: float, w: float) -> None:
        s = self._s
        s[0] += w
        s[1] += w * x
        s[2] += w * y
        s[3] += w * x * x
        s[4] += w * x * y

    def observe(self, k: int, cost: float) -> None:
        self._s = [v * self.decay for v in self._s]
        self._add(float(k), cost, 1.0)

    def predict(self, k: float) -> float:
        w, sx, sy, sxx, sxy = self._s
        var = w * sxx - sx * sx
        slope = (w * sxy - sx * sy) / var if var > 1e-12 else 0.0
        slope = max(slope, 0.0)
        intercept = (sy - slope * sx) / w
        return max(intercept + slope * k, 1e-6)


class TierLoad:
    """A tier's batching as the coordinator sees it: step time against tokens per step, sessions per
    step, and each call's time beyond its step (network, queueing). Shared by all sessions."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.step_cost = LinearCost(decay, prior_intercept=50.0, prior_slope=3.0)  # ms vs tokens in a step
        self.sessions = 1.0  # sessions per step, exponentially weighted
        self.overhead_ms = 0.0  # wall time beyond the step, exponentially weighted
        self.observations = 0

    def observe(self, batch_sessions: int, batch_tokens: int, step_ms: float, wall_ms: float) -> None:
        if batch_sessions <= 0 or batch_tokens <= 0:
            return  # a tier that reports no batching (an older replica)
        d = self.decay if self.observations else 0.0
        self.step_cost.observe(batch_tokens, step_ms)
        self.sessions = d * self.sessions + (1 - d) * batch_sessions
        self.overhead_ms = d * self.overhead_ms + (1 - d) * max(0.0, wall_ms - step_ms)
        self.observations += 1

    def round_ms(self, k: int) -> float:
        """Predicted verify time for K drafts when the step's sessions all send K."""
        return self.overhead_ms + self.step_cost.predict(self.sessions * (k + 1))


@dataclass(frozen=True)
class AdaptiveConfig:
    max_k: int = 8  # largest K tried
    start_k: int = 3  # K of the first round
    decay: float = 0.9  # weight of the past per round (~10-round memory)
    prior_acceptance: float = 0.5  # acceptance assumed before any round
    probe_every: int = 8  # when K = 0 wins, probe K = 1 this often


class AdaptiveK:
    """Per-session, per-proposer controller. Times are in milliseconds."""

    def __init__(self, config: AdaptiveConfig, local_proposer: bool, load: TierLoad | None = None) -> None:
        """load: the target's shared load model; None = use this session's own verify timings only."""
        self.config = config
        self.load = load
        self._acc_num = config.prior_acceptance  # weighted accepted drafts
        self._acc_den = 1.0  # weighted draft attempts
        # A remote draft costs about a network hop plus a few ms per token; a local lookup nothing.
        self.propose_cost = LinearCost(config.decay, 0.0 if local_proposer else 1.0, 0.0 if local_proposer else 5.0)
        self.verify_cost = LinearCost(config.decay, 50.0, 3.0)
        self._since_probe = 0
        self._rounds = 0

    @property
    def acceptance(self) -> float:
        return min(self._acc_num / self._acc_den, 1.0)

    def observe(self, k: int, n_accepted: int, propose_ms: float, verify_ms: float) -> None:
        """One round: K proposed (after clamping), n accepted, and the two rpcs' wall times."""
        self._rounds += 1
        d = self.config.decay
        if k > 0:
            # Each accepted draft is a success; the first rejection (if any) one failure.
            attempts = n_accepted + (1 if n_accepted < k else 0)
            self._acc_num = self._acc_num * d + n_accepted
            self._acc_den = self._acc_den * d + attempts
            self.propose_cost.observe(k, propose_ms)
        self.verify_cost.observe(k, verify_ms)

    def choose(self) -> int:
        c = self.config
        if self._rounds == 0:
            return c.start_k
        a = self.acceptance

        loaded = self.load is not None and self.load.observations > 0

        def rate(k: int) -> float:
            verify = self.load.round_ms(k) if loaded else self.verify_cost.predict(k)
            cost = verify + (self.propose_cost.predict(k) if k > 0 else 0.0)
            return expected_tokens(a, k) / cost

        best = max(range(c.max_k + 1), key=rate)
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= c.probe_every:
                self._since_probe = 0
                return 1
        return best
