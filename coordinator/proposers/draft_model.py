"""The draft model as a strategy: the remote draft tier, over the session's stream to it (its TierSession). It
proposes a chain of K tokens, E(K) = (1 - a^(K+1)) / (1 - a) at C(K) = verify(K) + propose(K), or its best
token tree (draft_tree.py); propose(K) is the draft tier's price at its load times the session's measured
ratio of its proposals' wall time to it, learnt on steady rounds (docs/DESIGN.md, Choosing the proposer and K).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_tree import DraftTrees, TreeAsk
from coordinator.proposers.estimates import Acceptance, Ratio, SharedPriors, expected_tokens
from coordinator.proposers.local import MIN_ATTEMPTS
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.strategy import Ask, Outcome, Prediction, Strategy
from coordinator.proposers.tier_cost import TierCost
from coordinator.stats import RoundStats
from coordinator.tiers.session import TierSession
from coordinator.tiers.target import Verdict
from specdec.core.settings import setting
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2
from specdec.serving.features import SessionFeatures

# A draft that drafts every round is fed 1-2 committed tokens before its K steps (the correction, or the
# last draft and the bonus); a larger catch-up (the prompt, or the rounds it sat out) is a one-off cost.
STEADY_CATCH_UP = 2


@dataclass(frozen=True)
class DraftModelConfig:
    """The draft-model strategy."""

    prior_acceptance: float = 0.5  # per-token acceptance before any round (and before any session taught one)
    decay: float = 0.9  # weight of the past per round in its estimates (~10-round memory)
    # Offer nothing while the target batches more than this many sessions (0 = any number): where the tiers
    # share a machine's cores or one GPU, a draft step under load runs beside the busy target's and both slow
    # down more than any price shows. vLLM's speculative_disable_by_batch_size (specdec serve / run-local set 1).
    max_sessions: int = setting(0, flag="draft-max-sessions")
    prior_overhead_ms: float = 1.0  # a call's cost beside its steps, before any call was timed
    prior_step_ms: float = 5.0  # a draft step's cost where the tier reported no curve


class DraftModelStrategy(Strategy):
    source = DRAFT_MODEL  # it learns only from the rounds it proposes

    def __init__(self, config: DraftModelConfig, session: TierSession, sampling: common_pb2.SamplingParams, seed: int,
                 stats: RoundStats, *, cost: TierCost | None = None, max_context: int = 0, trees: DraftTrees | None = None,
                 grammar: str = "", greedy: bool = True, priors: SharedPriors | None = None,
                 push: bool = False, features: SessionFeatures | None = None) -> None:
        """session: the draft's TierSession (cursor, routing, back-off). cost: the draft tier's prices (None: the
        config's prior line). max_context: the draft's. trees: trees and the speculation cache (None: chains
        only). grammar: structured output's, which masks q. push: ask for pushed proposals (DESIGN.md, The
        split's cost). features: an EAGLE-3 head's target rows (nothing is offered until they cover the context)."""
        self.features = features
        self.config, self.session, self.sampling, self.seed, self.stats = config, session, sampling, seed, stats
        self.cost = cost or TierCost(prior_intercept=config.prior_step_ms, prior_slope=0.0)
        self.max_context, self.trees, self.grammar = max_context, trees, grammar
        self.greedy, self.priors = greedy, priors
        start = priors.get(DRAFT_MODEL, greedy, "acceptance", config.prior_acceptance) if priors else config.prior_acceptance
        self.acceptance = Acceptance(config.decay, start)
        self.time_ratio = Ratio(config.decay)  # its proposals' wall time / their price, on steady rounds
        self.cost.live += 1  # until close()
        self._open = True
        self._fixed = False  # this round's ask is the request's own K
        self._draft_ms = 0.0  # a proposal's wall time when not pre-drafted (weighted), for the overlap's savings
        self.push = push
        self._asked: tuple | None = None  # the shape of the last request (a push holds for that shape only)

    @property
    def available(self) -> bool:
        """False while the draft tier is left alone after a failure (its TierSession's back-off)."""
        return self.session.available

    def price_line(self) -> tuple[float, float]:
        """(a call's overhead, a draft step) at the draft tier's current load: k steps are priced overhead + k step."""
        overhead = self.cost.overhead.predict(0) if self.cost.observations else self.config.prior_overhead_ms
        return overhead, self.cost.step_ms(1)

    def price(self, k: int) -> float:
        """k draft steps at the draft tier's current load, and the call's overhead."""
        overhead, step = self.price_line()
        return overhead + k * step

    def propose_ms(self) -> Callable[[int], float]:
        """k -> its predicted time for k draft steps: the price times its measured ratio; the draft tier's prices read
        once (a round asks it of every k)."""
        (overhead, step), ratio = self.price_line(), self.time_ratio.value
        return lambda k: ratio * (overhead + k * step)

    def catch_up_ms(self, ask: Ask) -> float:
        """What the committed tokens the draft tier has not seen add to its first step (fed with it, at the price
        of a token fed the tier timed at start), beyond the 1-2 of a draft that drafts every round, which its
        measured ratio holds: a draft that sat out rounds pays for them when it drafts again."""
        feed = ask.context - self.session.cached
        return feed * self.cost.feed_token_ms if feed > STEADY_CATCH_UP else 0.0

    def predict(self, ask: Ask) -> list[Prediction]:
        c = self.config
        self._fixed = ask.fixed
        if (not self.session.available or ask.context + ask.k > self.max_context
                or (self.features is not None and not self.features.ready(ask.context))
                or (c.max_sessions and not ask.fixed and ask.batch > c.max_sessions)):
            return []
        a, out, steps_ms = self.acceptance.value, [], self.propose_ms()
        feed_ms = self.catch_up_ms(ask)
        propose_ms = (lambda k: steps_ms(k) + feed_ms) if feed_ms else steps_ms
        if ask.fixed and self.trees is not None and (tree := self.trees.fixed(ask.k, a, ask.nodes)) is not None:
            e, cost = self.trees.expected(a, tree.nodes, tree.depth), ask.verify_ms[tree.nodes] + propose_ms(ask.k)
            return [Prediction(self, ask.k, e, cost, tree.nodes, tree.branching, calls=2)]  # the request's K, as a tree
        for k in range(ask.k if ask.fixed else 1, ask.k + 1):
            out.append(Prediction(self, k, expected_tokens(a, k), ask.verify_ms[k] + propose_ms(k), calls=2))
        if self.trees is not None and not ask.fixed:
            found = self.trees.best(a, propose_ms, ask.verify_ms, ask.k, ask.nodes)
            if found is not None:
                e, cost, tree = found
                out.append(Prediction(self, tree.depth, e, cost, tree.nodes, tree.branching, calls=2))
        return out

    async def propose(self, choice: Prediction, committed: list[int], hashes: PrefixHashes) -> Proposal:
        """Raises TierError if the draft is unreachable (the drafter falls back)."""
        k, tree = choice.k, TreeAsk(choice.nodes, choice.k, choice.branching) if choice.nodes else None
        if tree is not None and self.trees is not None:
            self.trees.asked(tree, self.acceptance.value, 0.0 if self._fixed else choice.cost_ms)  # a fixed K: no time

        def request(ctx: common_pb2.SessionContext) -> draft_pb2.ProposeRequest:
            message = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=self.sampling, seed=self.seed,
                                               grammar=self.grammar)
            if self.trees is not None:
                self.trees.request_fields(message, tree, k, runs_on=choice.run_on > 0)
            message.push = self.push and message.speculate > 0
            if self.features is not None:
                message.features_start, message.features = self.features.for_draft(ctx.prefix_len)
            return message

        asked = (k, tree)
        pushed = self.session.pushed(committed, hashes) if asked == self._asked and self.push else None
        self._asked = asked
        if pushed is not None:  # ready when the verdict came: no round trip; the request only moves the draft on
            await self.session.send_only(committed, hashes, request)
            self.stats.pushed_rounds += 1
            self.stats.observe_overlapped(0.0, saved_ms=self._draft_ms)  # pre-drafted too: a whole draft call saved
            return Proposal(DRAFT_MODEL, list(pushed.tokens), list(pushed.q), k=k,
                            parents=list(pushed.parents), tree_scheme=pushed.tree_scheme, overlapped=True)
        # A tree's nodes are not in the cursor's tail (the draft moves the accepted path's entries into place).
        reply = await self.session.call(committed, hashes, request,
                                        extra=lambda response: [] if response.parents else list(response.tokens))
        r = reply.message
        if self.features is not None:
            self.features.sent()
        proposal = Proposal(DRAFT_MODEL, list(r.tokens), list(r.q), wall_ms=reply.wall_ms, compute_ms=r.compute_ms,
                            queue_ms=r.queue_ms, k=k, catch_up=reply.fed, parents=list(r.parents),
                            tree_scheme=r.tree_scheme, overlapped=r.speculated)
        self.stats.observe_rpc(proposal.wall_ms, proposal.compute_ms, proposal.queue_ms, is_draft=True)
        if proposal.overlapped:  # the speculation cache had it ready: a draft call's time saved
            self.stats.observe_overlapped(0.0, saved_ms=max(0.0, self._draft_ms - proposal.wall_ms))
            return proposal
        self.cost.observe(r.batch_sessions, r.batch_sessions, r.step_ms, reply.wall_ms, r.compute_ms, r.queue_ms,
                          step_id=r.step_id)  # a token a session
        if proposal.tokens:
            self._draft_ms = 0.8 * self._draft_ms + 0.2 * proposal.wall_ms if self._draft_ms else proposal.wall_ms
        return proposal

    def observe(self, outcome: Outcome) -> None:
        p = outcome.proposal
        if p.source != DRAFT_MODEL or not p.tokens:
            return
        if p.catch_up <= STEADY_CATCH_UP:  # one draft step per level, as a chain's K
            self.time_ratio.observe(p.wall_ms, self.price(p.k))
        if p.parents and self.trees is not None:  # which sibling held at each level; the round's time
            timed = not (p.overlapped or p.run_on)  # (a run-on's steps are not the tree's)
            self.trees.observe(p.parents, outcome.path, p.wall_ms + outcome.verify_ms if timed else 0.0)
        else:
            self.acceptance.judge(len(p.tokens), len(outcome.path))

    async def while_verifying(self, verifying: Awaitable[Verdict]) -> Verdict:
        """The target's verdict, with the draft's pushes filed as they arrive meanwhile."""
        return await self.session.pushes_until(verifying) if self.push else await verifying

    async def close(self) -> None:
        if self.priors is not None and self.acceptance.attempts >= MIN_ATTEMPTS:
            self.priors.learn(DRAFT_MODEL, self.greedy, acceptance=self.acceptance.value)
        if self.trees is not None:
            self.trees.teach(self.acceptance.value)
        if self._open:
            self._open = False
            self.cost.live -= 1
        await self.session.close()
