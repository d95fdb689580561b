"""Which strategy proposes a round, and what shape: the most predicted tokens per predicted second.

Every round the policy prices verification at the target's current load (tier_cost.TierCost: the round's
time when every session of the step scores n drafts, from the curve the tier measured at start and the steps
it has reported since), asks every strategy of the session for its predictions within that price (each
shape it could propose: a chain of K, a tree of N nodes and depth D, with the tokens it would commit and the
round's time), adds K = 0 (the target alone: one token for verify(0)) and picks the largest rate. It knows
nothing else about the strategies. Each prediction's time also carries the coordinator's own CPU for its
tier calls (coordinator_cost.py: in series with the round, and under load the floor that one event loop
serving every generation puts under it), as does K = 0's.

Drafting must beat K = 0 by PolicyConfig.min_gain (5%): the largest of many noisy estimates overstates its
own value (the optimizer's curse), and where drafting was predicted to gain a few percent (a batch of sessions
on the steep part of the step's curve, drafts accepted a fifth of the time) it measured a few percent slower.
When K = 0 wins, the best K = 1 is still probed after probe_every rounds so its estimates can recover, the
interval doubling after each probe while K = 0 keeps winning (to probe_max_every; back to probe_every once
drafting wins): a probe costs a draft round trip, and on a tiny pair whose step costs less than the round
trip (a GPU's regime) probing every 8th round cost the default request ~5% against K = 0 (bench.concurrency),
unless its strategy judges its unchosen offers for free (a local chain in a greedy session): a probe would
only spend a row of the step on a draft the policy expects to lose (under load, measured: probing every 8th round cost ~4% of a
16-session burst's tokens/s). A request's own K (fixed) has no K = 0 option, and a reproducible request
(measured=False) is priced from priors alone, so no timing sways which strategy proposes.
Cost: O(strategies x shapes) arithmetic per round, a few microseconds; with draft trees ~0.1 ms more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.proposers.coordinator_cost import round_ms
from coordinator.proposers.strategy import Ask, Prediction, Strategy


@dataclass(frozen=True)
class PolicyConfig:
    """Adaptive K: the policy choosing each round's strategy and shape."""

    max_k: int = 8  # the deepest proposal tried (drafts per path)
    probe_every: int = 8  # when K = 0 wins, probe a K = 1 this often
    probe_max_every: int = 64  # probes that keep losing back off, the interval doubling up to this
    min_gain: float = 1.05  # draft only where the predicted tokens per unit of time beat K = 0's by this factor
    price_coordinator: bool = True  # charge the coordinator's own CPU per tier call, in series and as a floor under load


class Policy:
    """Per session: the per-round choice among its strategies."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._since_probe = 0
        self._probe_every = config.probe_every  # doubles after each probe while K = 0 keeps winning

    def choose(self, strategies: Sequence[Strategy], ask: Ask) -> Prediction | None:
        """The best prediction of any strategy, or None for K = 0 (the target alone)."""
        if ask.k <= 0:
            return None
        predictions = [p for s in strategies for p in s.predict(ask)]

        def rate(p: Prediction) -> float:  # tokens per ms, the coordinator's own time charged
            return p.tokens / max(round_ms(p.cost_ms, p.calls, ask.call_ms, ask.in_flight), 1e-6)

        best = max(predictions, key=rate, default=None)
        if ask.fixed or best is None:
            return best
        if rate(best) > self.config.min_gain / round_ms(ask.verify_ms[0], 1, ask.call_ms, ask.in_flight):
            self._probe_every = self.config.probe_every
            return best
        self._since_probe += 1
        probe = max((p for p in predictions if p.k == 1 and not p.nodes), key=rate, default=None)
        if self._since_probe < self._probe_every or probe is None or probe.by.judged_unchosen:
            return None
        self._since_probe = 0
        self._probe_every = min(2 * self._probe_every, max(self.config.probe_max_every, self.config.probe_every))
        return probe
