"""Drafter: one session's strategies and policy, as the round loop sees them (propose, verify, observe, commit,
finish, close). If the draft tier is unreachable the model-free strategies stand in (a fallback round)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from coordinator.params import GenerationParams
from coordinator.proposers.base import Proposal
from coordinator.proposers.coordinator_cost import CoordinatorCost
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.policy import Policy, run_on_at
from coordinator.proposers.strategy import Ask, Outcome, Strategy
from coordinator.proposers.suffix_cache import SuffixCache
from coordinator.proposers.tier_cost import TierCost
from coordinator.tiers.client import TierError
from coordinator.tiers.target import Verdict
from specdec.core.prefix import PrefixHashes


class Drafter:
    def __init__(self, params: GenerationParams, policy: Policy, strategies: Sequence[Strategy], fallback: Strategy,
                 target: TierCost, *, max_k: int, suffix_cache: SuffixCache | None = None, cache_context: int = 0,
                 coordinator: CoordinatorCost | None = None) -> None:
        """strategies: model-free ones first; fallback: prompt lookup, for an unreachable draft tier. target: its
        prices. max_k: the server's and tiers' cap on K and a tree's nodes. suffix_cache: the shared tree that the
        output joins at close(), after cache_context prompt tokens. coordinator: its CPU per tier call (None or
        PolicyConfig.price_coordinator off: not charged)."""
        self.params, self.policy, self.target, self.max_k = params, policy, target, max_k
        self.coordinator = coordinator if policy.config.price_coordinator else None
        self.strategies = list(strategies)
        self.fallback = fallback
        self.every = self.strategies + [fallback] * (fallback not in self.strategies)  # all that learn and commit
        self.suffix_cache, self.cache_context = suffix_cache, cache_context
        self._output: list[int] | None = None  # the finished session's tokens, for the shared suffix tree
        self._alone = 0  # target-only rounds in a row, up to this one (the run-on grows with them)
        self._starting: asyncio.Future | None = None  # the strategies' start, while it runs (start())

    async def start(self) -> None:
        """The strategies' start (suffix decoding and prompt lookup indexing the prompt) in a task of its own, so
        that the first round's request goes out meanwhile: a strategy not yet ready is not asked, and started() must
        be awaited before the first commit. A request's own K waits for it (its first round is asked of every strategy)."""
        if self.never_drafts:
            return
        self._starting = asyncio.ensure_future(self._start_all())

    async def _start_all(self) -> None:
        for s in self.every:
            await s.start()

    async def started(self) -> None:
        """Every strategy has started (its indexes hold the prompt): before anything is committed."""
        if self._starting is not None:
            starting, self._starting = self._starting, None
            await starting

    async def propose(self, committed: list[int], hashes: PrefixHashes, limit: int) -> Proposal:
        """The round's drafts with their q rows, for a round that may commit at most `limit` tokens."""
        budget, k = max(min(self.max_k, limit - 1), 0), self.params.num_speculative_tokens  # a round adds one of its own
        if k is not None or (self._starting is not None and self._starting.done()):
            await self.started()
        k = min(budget, self.policy.config.max_k if k is None else k)
        draft_down = any(s.source == DRAFT_MODEL and not s.available for s in self.strategies)
        local = [s for s in self.strategies if s.source != DRAFT_MODEL]
        # Draft mode with the draft down, or with no draft tier at all: prompt lookup.
        strategies = self.strategies if local or (self.strategies and not draft_down) else [self.fallback]
        strategies = [s for s in strategies if s.ready]  # (one still indexing the prompt is asked from the next round)
        # The run-on of rounds that run on in a streak: further where no reader waits on a round's end (the whole
        # result read, or the run-on streamed in parts), unless a stop string or token (which only the coordinator
        # sees) may end the answer inside a long run-on, its steps then wasted
        c = self.policy.config
        parts = c.run_on_part if not self.params.whole_result and self.params.logprobs < 0 else 0
        long = (self.params.whole_result or parts > 0) and not (self.params.stop or self.params.stop_token_ids)
        cap = min(c.run_on_whole if long else c.run_on, max(limit - 1, 0))
        run_on = run_on_at(self._alone, cap)  # this one's, if K = 0
        if k <= 0:  # nothing to draft: no prices, no strategy asked
            return self._target_only(strategies, draft_down, run_on, parts)
        call_ms = self.coordinator.call_ms if self.coordinator is not None else 0.0
        verify_ms = self.target.verify_ms(max(k, self.max_k))
        ask = Ask(k, self.max_k, self.params.num_speculative_tokens is not None, verify_ms, self.target.batch,
                  len(committed), call_ms, max(self.target.live, 1),
                  # K = 0 priced at the run-on a streak of target-only rounds reaches, not at the ramp's step now:
                  # after a drafting round the ramp starts over, and K = 0 priced at one token a round trip made
                  # the next draft look better than it is (docs/performance.md, Cold burst)
                  cap,
                  self.target.step_ms(1),
                  self._alone)
        choice = self.policy.choose(strategies, ask)
        try:
            proposal = await choice.by.propose(choice, committed, hashes) if choice is not None else None
        except TierError:  # counted, and the draft left alone for a back-off, by its TierSession
            draft_down, strategies = True, local or [self.fallback]  # the best model-free offer instead
            choice = self.policy.choose(strategies, ask)
            proposal = await choice.by.propose(choice, committed, hashes) if choice is not None else None
        if proposal is None:
            return self._target_only(strategies, draft_down, run_on, parts)
        proposal.fallback = draft_down and proposal.source != DRAFT_MODEL
        proposal.run_on = min(choice.run_on, max(limit - 1 - choice.k, 0))  # (drafts and run-on within the limit)
        proposal.run_on_part = parts
        if choice.run_on:  # it runs on as this round's K = 0 would: the ramp goes on
            self._alone += 1
        elif not self.policy.probing:  # (a probe is K = 0's exploration: the run-on goes on where it was after it)
            self._alone = 0
        return proposal

    def _target_only(self, strategies: Sequence[Strategy], draft_down: bool, run_on: int, parts: int) -> Proposal:
        """A K = 0 round, charged to the first strategy; the target runs on by itself for 0, 1, 3, 7, ... tokens
        (up to the policy's cap and the budget) as such rounds follow one another, sent in parts where asked."""
        self._alone += 1
        return Proposal(strategies[0].source if strategies else DRAFT_MODEL, [], k=0, fallback=draft_down, run_on=run_on,
                        run_on_part=parts)

    async def verify(self, verifying: Awaitable[Verdict], proposal: Proposal) -> Verdict:
        """The target's verdict on `proposal`; its strategy may use the wait (the draft model files its pushes)."""
        by = next((s for s in self.every if s.source == proposal.source), None)
        return await (by.while_verifying(verifying) if by is not None and proposal.tokens else verifying)

    @property
    def never_drafts(self) -> bool:
        """A request whose K is 0 throughout: no strategy needs its rounds or its tokens."""
        return self.params.num_speculative_tokens == 0

    def observe(self, proposal: Proposal, verdict: Verdict, accepted: Sequence[int]) -> None:
        """The round's outcome: accepted = the accepted drafts + the next token."""
        if self.never_drafts:
            return
        path = verdict.path if proposal.parents else range(verdict.num_accepted)
        outcome = Outcome(proposal, accepted, path, verdict.wall_ms)
        for s in self.every:
            s.observe(outcome)

    def commit(self, tokens: list[int]) -> None:
        """Tokens just committed."""
        if self.never_drafts:
            return
        for s in self.every:
            s.commit(tokens)

    def finish(self, committed: list[int]) -> None:
        """The generation finished with these tokens: its output joins the shared suffix tree at close()."""
        prompt_len = len(self.params.prompt_ids)
        self._output = committed[prompt_len - min(self.cache_context, prompt_len):]

    async def close(self) -> None:
        """Each strategy teaches the shared priors and ends its remote session (best effort)."""
        await self.started()
        for s in self.every:
            await s.close()
        if self.suffix_cache is not None and self._output is not None:
            await self.suffix_cache.add_async(self._output)
