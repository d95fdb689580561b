"""Fakes for the proposer tests: a model-free strategy whose offer is set by hand, the draft tier as a
strategy's session (always reachable, never called), a target tier's status with a cost curve, and the Ask
a round would make. The strategies, the policy and the tier prices under test are the real ones."""

from __future__ import annotations

import asyncio
import dataclasses

from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_model import DraftModelConfig, DraftModelStrategy
from coordinator.proposers.draft_tree import DraftTrees
from coordinator.proposers.estimates import SharedPriors
from coordinator.proposers.local import LocalStrategy
from coordinator.proposers.strategy import Ask, Outcome
from coordinator.proposers.tier_cost import TierCost
from coordinator.stats import RoundStats
from specdec.proto import common_pb2


class Offer(LocalStrategy):
    """A model-free strategy (the real base: its estimates, prices and judging) whose offer is `next`."""

    def __init__(self, source: str, *, greedy: bool = True, priors: SharedPriors | None = None,
                 prior_acceptance: float = 0.5, watch: int = 0) -> None:
        self.source = source
        super().__init__(prior_acceptance, 0.9, greedy=greedy, priors=priors, watch=watch)
        self.next = Proposal(source, [])

    def offer(self, k: int, tree_nodes: int = 0) -> Proposal:
        return dataclasses.replace(self.next, tokens=self.next.tokens[:k], probs=self.next.probs[:k])

    def commit(self, tokens) -> None:
        pass


class DraftTier:
    """The draft tier as the draft-model strategy's session, reachable; the policy tests never call it."""

    available = True
    cached = 0  # committed tokens it holds (the rounds these tests ask have no context)

    async def close(self) -> None:
        pass


def started(strategy):
    """A strategy after its start() (a prompt indexed), as the drafter runs it beside the first round."""
    asyncio.run(strategy.start())
    return strategy


def draft(config: DraftModelConfig = DraftModelConfig(), *, greedy: bool = True, priors: SharedPriors | None = None,
          trees: DraftTrees | None = None, cost: TierCost | None = None) -> DraftModelStrategy:
    return DraftModelStrategy(config, DraftTier(), common_pb2.SamplingParams(), 1, RoundStats(), cost=cost,
                              max_context=10_000, trees=trees, greedy=greedy, priors=priors)


def ask(cost: TierCost | None = None, k: int = 8, *, nodes: int = 0, fixed: bool = False) -> Ask:
    """What a round asks of its strategies, priced by `cost` (default: a target with nothing measured)."""
    cost = cost or TierCost()
    return Ask(k, nodes, fixed, cost.verify_ms(max(k, nodes)), cost.batch)


def status(step) -> common_pb2.StatusResponse:
    """A target's status reporting the cost curve of a tier whose step of n tokens over b sessions takes step(n, b) ms."""
    points = [(b, b * t) for b in (1, 2, 4, 8, 16, 32) for t in (1, 2, 4, 8)]
    return common_pb2.StatusResponse(cost_curve=[common_pb2.StepCost(sessions=b, tokens=n, ms=step(n, b)) for b, n in points])


def outcome(proposal: Proposal, n: int, accepted=None, verify_ms: float = 50.0) -> Outcome:
    """A verified chain round: its first n drafts accepted (and a token of the target's)."""
    accepted = list(proposal.tokens[:n]) + [-1] if accepted is None else accepted
    return Outcome(proposal, accepted, range(n), verify_ms)


def target_only(source: str = "prompt_lookup") -> Proposal:
    return Proposal(source, [])
