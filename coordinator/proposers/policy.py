"""Which proposer drafts a round, and how many tokens: the best expected tokens per unit of time.

Every round the local sources (suffix tree, prompt lookup: microseconds, here in the coordinator)
offer their chains; the draft model (a round trip to the draft tier) could offer any K up to max_k,
unseen until asked. For each source and K the policy predicts the tokens the round commits, E(K),
and its wall time, C(K):
  E(K) = 1 + expected accepted drafts: (1 - a^(K+1)) / (1 - a) - 1 for the source's measured
         per-token acceptance a; for a chain with the suffix tree's own estimate (probs[i] =
         P(first i+1 drafts right)), the sum of probs[:K] times the measured ratio of accepted to
         estimated drafts (so a tree that is too confident is discounted);
  C(K) = verify(K) + propose(K): linear fits of measured wall times (verify shared by all sources);
         once the target's load is known (TierLoad: its step time against tokens per step, a curve,
         and B sessions per step), verify(K) = overhead + T_step(B (K + 1)), the round when every
         session of the step sends K, so K falls as the batch grows.
With the draft model's token trees on, its best tree (N nodes, depth D: coordinator/proposers/draft_tree.py,
which predicts E and C for every shape) is one more option beside the chains.
It picks the (source, K) with the largest E(K) / C(K), K = 0 (target only, E = 1) included, drafting only
where that beats K = 0 by AdaptiveConfig.min_gain (5%): the largest of many noisy estimates overstates
its own value (the optimizer's curse), and where drafting is predicted to gain a few percent (a batch of
sessions on the steep part of the step's curve, drafts accepted a fifth of the time) it measured a few
percent slower instead. A session's acceptance estimates and ratios start from what the coordinator's
earlier sessions learnt (SourcePriors; not for reproducible requests), and at its end it teaches them
what it measured. The draft's
propose(K) is fitted on its steady rounds only (fed 1-2 committed tokens first): a call that first
catches up on the prompt or on rounds the draft sat out is a one-off cost, and counting it would make
a costly draft (the target's own low-precision copy) look dearer the less it is asked, until it is
never asked. The draft
is asked only when its rate wins. (A sampled request with a fixed K is meant to be reproducible: there
C(K) comes from the priors alone, so no timing sways which source proposes.) When K = 0 wins, the best K = 1 is still probed every probe_every
rounds so the estimates can recover, unless that K = 1 is a local chain in a greedy session: there the
local chains that were not chosen are scored against the committed tokens (the target's own greedy
continuation) every round, free measurements that keep their estimates current, so a probe would only
spend a row of the step on a draft the policy expects to lose (under load, measured: probing every 8th
round cost ~4% of a 16-session burst's tokens/s).
Cost: O(sources x max_k) arithmetic per round, a few microseconds; with trees O(max_k x max_nodes log max_nodes)
more, ~0.1 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from coordinator.proposers.adaptive import AcceptanceRatio, AdaptiveConfig, LinearCost, SourceEstimate, SourcePriors, TierLoad
from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_tree import DraftTreePolicy, TreeAsk
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.token_tree import match


# A draft that drafts every round is fed 1-2 committed tokens before its K steps (the correction, or the
# last draft and the bonus); a larger catch-up (the prompt, or the rounds it sat out) is a one-off cost.
STEADY_CATCH_UP = 2


@dataclass(frozen=True)
class Choice:
    source: str  # who proposes; for K = 0 the source the round is charged to
    k: int  # drafts to propose (0 = target only); for a tree its depth
    tree: TreeAsk | None = None  # the draft model's token tree to ask for instead of a chain (None: a chain)


class ProposerPolicy:
    """Per session: estimates for every source, and the per-round choice."""

    def __init__(self, config: AdaptiveConfig, sources: Sequence[str], load: TierLoad | None = None,
                 priors: SourcePriors | None = None, greedy: bool = True) -> None:
        """load: the target's batching, shared by the coordinator's sessions (None: this session's own
        verify timings only). priors: what earlier sessions learnt (None: the config's priors); greedy:
        whether this session is greedy (priors are kept apart for greedy and sampled sessions)."""
        self.config = config
        self.load = load
        self.priors, self.greedy = priors, greedy
        self.verify_cost = LinearCost(config.decay, 50.0, 3.0)
        self.estimates = {s: SourceEstimate(config, local_proposer=s != DRAFT_MODEL, verify_cost=self.verify_cost,
                                            prior_acceptance=priors.acceptance(s, greedy) if priors else None)
                          for s in sources}
        self.ratios = {s: AcceptanceRatio(config.decay, prior=priors.ratio(s, greedy) if priors else 1.0) for s in sources}
        self._since_probe = 0

    def choose(self, offers: Sequence[Proposal], max_k: int, draft: bool, fixed: bool, measured_costs: bool = True,
               trees: DraftTreePolicy | None = None, max_nodes: int = 0) -> Choice:
        """offers: the local sources' chains (up to max_k tokens each); draft: whether the draft model
        may be asked; fixed: max_k is the request's K (no K = 0 option, no shorter K for the draft);
        measured_costs=False: costs from the priors, so that no timing sways the choice (reproducible
        sampling). trees: the draft model's trees, which compete with every chain and with K = 0 (at most
        max_nodes nodes, max_k deep; a fixed K's tree is the drafter's, DraftTreePolicy.fixed).
        O(sources x max_k + max_k x max_nodes log max_nodes)."""
        default = offers[0].source if offers else DRAFT_MODEL
        if max_k <= 0:
            return Choice(default, 0)
        candidates: list[tuple[Proposal | None, str, int]] = [(o, o.source, len(o.tokens)) for o in offers if o.tokens]
        if draft:
            candidates.append((None, DRAFT_MODEL, max_k))
        if not candidates:
            return Choice(default, 0)
        best = best_k1 = (0.0, default, 0)  # (rate, source, k); best_k1: the best K = 1 option, for probing
        verify = self.verify_costs(max(limit for _, _, limit in candidates), measured_costs)
        for offer, source, limit in candidates:
            est = self.estimates[source]
            p0, p1 = est.propose_cost.line(measured_costs)
            probs = offer.probs if offer is not None else None
            a, ratio = est.acceptance, self.ratios[source].value
            expected, a_k, cumulative = 1.0, 1.0, 0.0  # E(k): tokens the round commits, bonus included
            for k in range(1, limit + 1):
                if probs:  # the tree's estimate, scaled by how its estimates have fared
                    cumulative += probs[k - 1]
                    expected = 1.0 + min(float(k), ratio * cumulative)
                else:  # geometric: 1 + a + ... + a^k
                    a_k *= a
                    expected += a_k
                if fixed and k < limit:
                    continue
                rate = expected / (verify[k] + max(p0 + p1 * k, 1e-6))
                if rate > best[0]:
                    best = (rate, source, k)
                if k == 1 and rate > best_k1[0]:
                    best_k1 = (rate, source, k)
        if fixed:
            return Choice(best[1], best[2])
        tree = None
        if draft and trees is not None:
            found = trees.best(self.estimates[DRAFT_MODEL], self.verify_costs(max(max_k, max_nodes), measured_costs),
                               max_k, max_nodes, measured_costs)
            if found is not None and found[0] > best[0]:
                best, tree = (found[0], DRAFT_MODEL, found[1].depth), found[1]
        target_only = 1.0 / verify[0]
        if target_only * self.config.min_gain >= best[0]:
            self._since_probe += 1
            if self._since_probe < self.config.probe_every or self.measured_free(best_k1[1]):
                return Choice(default, 0)
            self._since_probe = 0
            best, tree = best_k1, None
        return Choice(best[1], best[2], tree)

    def teach(self) -> None:
        """At the session's end: hand what it measured to the shared priors (the sources it judged often
        enough: SourcePriors.MIN_ATTEMPTS drafts)."""
        if self.priors is None:
            return
        for source, est in self.estimates.items():
            if est.attempts >= SourcePriors.MIN_ATTEMPTS:
                ratio = self.ratios[source]
                self.priors.learn(source, self.greedy, est.acceptance, ratio.value if ratio.observations else None)

    def draft_allowed(self, fixed: bool) -> bool:
        """Whether the draft model may be asked this round: always for a request's own K; otherwise not
        while more sessions than AdaptiveConfig.draft_max_sessions are open on the target."""
        limit = self.config.draft_max_sessions
        return fixed or not limit or self.load is None or self.load.live <= limit

    def measured_free(self, source: str) -> bool:
        """Whether the source's chains are judged every round without being verified (observe_unchosen):
        a local proposer in a greedy session."""
        return self.greedy and source != DRAFT_MODEL

    def verify_costs(self, n: int, measured_costs: bool = True) -> list[float]:
        """The predicted verify time (ms) of a round scoring k = 0..n drafts: from the target's load once it
        is known (TierLoad.round_ms), else this session's own linear fit."""
        if measured_costs and self.load is not None and self.load.observations > 0:
            return list(accumulate((max(self.load.round_ms(k), 1e-6) for k in range(n + 1)), max))  # never falling
        return [self.verify_cost.predict(k, measured_costs) for k in range(n + 1)]

    def observe(self, proposal: Proposal, k: int, n_accepted: int, verify_ms: float) -> None:
        """The round's outcome: k drafts of proposal verified, n accepted."""
        steady = proposal.catch_up <= STEADY_CATCH_UP
        self.estimates[proposal.source].observe(k, n_accepted, proposal.wall_ms, verify_ms, steady)
        if k > 0 and proposal.probs:
            self.ratios[proposal.source].observe(n_accepted, sum(proposal.probs[:k]))

    def observe_unchosen(self, offers: Sequence[Proposal], chosen: str | None, committed: Sequence[int]) -> None:
        """Greedy rounds only: committed is the target's own continuation (accepted drafts + next
        token), so each local chain but the chosen one (None: a target-only round) is judged by its
        common prefix with it."""
        for offer in offers:
            if offer.source == chosen or not offer.tokens:
                continue
            k = min(len(offer.tokens), len(committed))
            if offer.parents:  # a tree: the path the greedy walk would have taken
                n = len(match(offer.tokens, offer.parents, committed))
            else:
                n = 0
                while n < k and offer.tokens[n] == committed[n]:
                    n += 1
            est = self.estimates[offer.source]
            est.observe_acceptance(k, n)
            est.propose_cost.observe(len(offer.tokens), offer.wall_ms)
            if offer.probs:
                self.ratios[offer.source].observe(n, sum(offer.probs[:k]))
