"""The one interface every proposer implements, and what passes through it (docs/DESIGN.md, Choosing the
proposer and K)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from coordinator.proposers.base import Proposal
from specdec.core.proposer_names import Proposer
from coordinator.tiers.target import Verdict
from specdec.core.prefix import PrefixHashes


@dataclass(frozen=True)
class Ask:
    """What a round may propose, and at what price the target verifies it."""

    k: int  # the deepest proposal: drafts per path (the request's K, or the policy's max_k, within the budget)
    nodes: int  # the largest token tree (nodes); <= k: chains only
    fixed: bool  # exactly k: the request's own K (no K = 0, no shorter chain)
    verify_ms: Sequence[float]  # the predicted verify time of a round scoring n drafts, n = 0..max(k, nodes)
    batch: float = 1.0  # sessions per target step now (the load)
    context: int = 0  # the committed length
    call_ms: float = 0.0  # the coordinator's CPU per tier call (coordinator_cost.py; 0: not charged)
    in_flight: float = 1.0  # generations running on this coordinator now
    run_on: int = 0  # K = 0's price: the tokens target-only rounds run on for once they follow one another (the cap)
    step_ms: float = 0.0  # each of them: one target step of one token a session at the current batch
    streak: int = 0  # target-only rounds in a row before this one (a drafting round starts the run-on's ramp over)


@dataclass(frozen=True)
class Prediction:
    """One shape a strategy could propose this round, and what it would yield."""

    by: "Strategy"  # who would propose it
    k: int  # drafts per path (a chain's length, a tree's depth); for a local tree its first k nodes
    tokens: float  # E: tokens the round would commit, the bonus included
    cost_ms: float  # C: the round's time, proposing and verifying
    nodes: int = 0  # a draft-model tree's node budget (0: a chain)
    branching: int = 1  # a draft-model tree's children per expanded node
    calls: int = 1  # tier calls the round makes (a draft-model round: Propose and Verify)
    run_on: int = 0  # the policy's: the target decodes this many more tokens itself after the verdict


@dataclass(frozen=True)
class Outcome:
    """A verified round, as every strategy of the session observes it."""

    proposal: Proposal  # what was proposed (its source: the strategy; no tokens: a target-only round)
    accepted: Sequence[int]  # the accepted drafts and the target's token: in a greedy round, its own continuation
    path: Sequence[int]  # the accepted drafts' node indices (a chain: 0..n-1)
    verify_ms: float  # the target's round trip


class Strategy:
    """A proposer: it predicts what each shape it could propose would commit and cost, proposes the shape the
    policy picks, and observes every verified round, holding its own estimates and settings. Subclass it:
    predict, propose and observe; the rest does nothing unless overridden."""

    source: Proposer  # its name (API, stats, metrics)
    judged_unchosen = False  # it learns from rounds it did not propose (so the policy never probes it)
    ready = True  # it may be asked: False until start() has run where start() has work to do

    async def start(self) -> None:
        """Before it is first asked (e.g. index the prompt; the drafter runs it beside the first round)."""

    def predict(self, ask: Ask) -> list[Prediction]:
        """The shapes it could propose this round within `ask`, each priced (none: it has nothing to offer)."""
        raise NotImplementedError

    async def propose(self, choice: Prediction, committed: list[int], hashes: PrefixHashes) -> Proposal:
        """The proposal `choice` predicted (raises TierError if a remote strategy is unreachable)."""
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        """A verified round, its own or another strategy's."""
        raise NotImplementedError

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens just committed."""

    async def while_verifying(self, verifying: Awaitable[Verdict]) -> Verdict:
        """The verdict on its proposal, awaited (the draft model files its tier's pushes meanwhile)."""
        return await verifying

    async def close(self) -> None:
        """The session ended: teach the shared priors, end any remote session (best effort)."""
