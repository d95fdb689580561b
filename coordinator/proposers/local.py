"""What the model-free strategies (prompt lookup, suffix decoding) share: an offer made here in microseconds,
priced for each prefix of it at verify(k) alone (its CPU is charged by the policy), and in every round judged
whether chosen or not, against the tokens the round committed (docs/DESIGN.md, Choosing the proposer and K).

Why an offer not chosen can be judged, sampled or greedy: a model-free draft is deterministic (its q one-hot),
so d_1 is accepted with probability p_1(d_1), and given d_1..d_(i-1) accepted, d_i with p_i(d_i). The committed
tokens follow the target's law whoever proposed them (lossless), so the first of them equals d_1 with probability
p_1(d_1), and given d_1..d_(i-1) the i-th equals d_i with p_i(d_i): matching the offer against them has the law
of its own acceptance. (A draft model's q is not one-hot: min(1, p / q) is no such match, so it is probed.)"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import Acceptance, Calibration, SharedPriors
from coordinator.proposers.strategy import Ask, Outcome, Prediction, Strategy
from coordinator.proposers.token_tree import cut, match
from specdec.core.prefix import PrefixHashes

MIN_ATTEMPTS = 4  # drafts a session must have judged for its estimates to teach the shared priors


class LocalStrategy(Strategy):
    """A model-free strategy; subclasses set `source`, make offers (offer()) and follow the tokens (commit())."""

    def __init__(self, prior_acceptance: float, decay: float, *, greedy: bool = True, tree_nodes: int = 0,
                 priors: SharedPriors | None = None, watch: int = 0) -> None:
        """tree_nodes > 0: offer token trees of at most that many nodes. priors: where the estimates start and
        what they teach at the end (None: the config's prior, nothing taught). watch: in a session that starts
        from no taught prior, the drafts to judge (its offers against the committed tokens, free) before
        it may draft: a cold start drafts on evidence, not on the config's prior."""
        self.greedy, self.tree_nodes, self.priors = greedy, tree_nodes, priors
        taught = priors.get(self.source, greedy, "acceptance") if priors else None
        self.acceptance = Acceptance(decay, prior_acceptance if taught is None else taught)
        self.watch = watch if taught is None else 0
        self.calibration = Calibration(decay, priors.get(self.source, greedy, "calibration") if priors else None)
        self._offer: Proposal | None = None  # this round's offer
        self._depth = 0  # this round's depth budget

    judged_unchosen = True  # greedy or sampled: the module's docstring says why

    def offer(self, k: int, tree_nodes: int) -> Proposal:
        """Up to k tokens (a chain), or with tree_nodes > 0 a tree of at most that many nodes and depth k."""
        raise NotImplementedError

    def predict(self, ask: Ask) -> list[Prediction]:
        """E(k) for the offer's first k tokens: 1 + a + ... + a^k, or where the offer estimates its own chances
        (probs[i] = P(the first i + 1 drafts right)) 1 + the sum of their calibrated chances (Calibration)."""
        self._offer, self._depth = self.offer(ask.k, min(self.tree_nodes, len(ask.verify_ms) - 1)), ask.k
        offer = self._offer
        if self.acceptance.attempts < self.watch and not ask.fixed:  # still watching: judged, not drafted
            return []
        n_max = min(len(offer.tokens), len(ask.verify_ms) - 1)
        a, c = self.acceptance.value, self.calibration
        chances = c.chances(offer.probs[:n_max], offer.parents[:n_max]) if offer.probs else [a ** (i + 1) for i in range(n_max)]
        out = []
        for k, cumulative in enumerate(accumulate(chances), 1):
            if ask.fixed and k < n_max:
                continue
            out.append(Prediction(self, k, 1.0 + min(float(k), cumulative), ask.verify_ms[k]))
        return out

    async def propose(self, choice: Prediction, committed: list[int], hashes: PrefixHashes) -> Proposal:
        o, k = self._offer, choice.k
        if o.parents:  # a tree: its first k nodes, no deeper than the round's budget
            tokens, parents, probs = cut(o.tokens[:k], o.parents[:k], o.probs[:k], self._depth, k)
            return dataclasses.replace(o, tokens=tokens, parents=parents, probs=probs, k=k)
        return dataclasses.replace(o, tokens=o.tokens[:k], probs=o.probs[:k], k=k)

    def observe(self, outcome: Outcome) -> None:
        proposal = outcome.proposal
        if proposal.source == self.source and proposal.tokens:  # its own round
            self._judge(proposal, len(proposal.tokens), outcome.path)
        elif self._offer is not None and self._offer.tokens:  # judged against the committed tokens
            offer, accepted = self._offer, outcome.accepted
            if offer.parents:  # a tree: the path the committed tokens spell through it
                path = match(offer.tokens, offer.parents, accepted)
            else:
                path = range(next((i for i, (d, t) in enumerate(zip(offer.tokens, accepted)) if d != t),
                                  min(len(offer.tokens), len(accepted))))
            self._judge(offer, min(len(offer.tokens), len(accepted)), path)
        self._offer = None

    def _judge(self, proposal: Proposal, k: int, path) -> None:
        """k of its drafts judged (a tree: its first k nodes), path: those that were right (node indices)."""
        self.acceptance.judge(k, len(path))
        if proposal.probs:
            self.calibration.observe(proposal.probs[:k], proposal.parents[:k], set(path))

    async def close(self) -> None:
        if self.priors is not None and self.acceptance.attempts >= MIN_ATTEMPTS:
            self.priors.learn(self.source, self.greedy, acceptance=self.acceptance.value,
                              calibration=self.calibration.values if self.calibration.observations else None)
