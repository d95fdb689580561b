"""Drafter: one session's proposers and the policy that picks among them, as the round loop sees them.

propose() is the round's proposal: a block the draft model prefetched during the last verification if
that outcome happened, else the policy's pick (coordinator/proposers/policy.py) among the local sources'
offers (suffix tree, prompt lookup) and the draft model, cut to the round's budget. If the draft model is
unreachable, the local sources stand in (a fallback round). verify() awaits the target's verdict and,
with the overlap on, has the draft model prefetch the next block meanwhile. observe() and commit() keep
the estimates and the local sources' indexes current."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Sequence
from typing import Protocol

from coordinator.params import GenerationParams
from coordinator.proposers.base import Proposal
from coordinator.proposers.lookup import PromptLookupProposer
from coordinator.proposers.names import DRAFT_MODEL, HYBRID
from coordinator.proposers.policy import ProposerPolicy
from coordinator.proposers.suffix import SuffixCache, SuffixProposer
from coordinator.stats import RoundStats
from coordinator.tiers.client import TierError
from coordinator.tiers.target import Verdict
from specdec.core.prefix import PrefixHashes


class DraftModel(Protocol):
    """The draft model as a proposer (coordinator.proposers.draft_model.DraftModelProposer; a fake in tests)."""

    available: bool  # False while the draft tier is left alone after a failure

    async def propose(self, committed: list[int], hashes: PrefixHashes, k: int) -> Proposal: ...

    async def prefetch(self, committed: list[int], hashes: PrefixHashes, drafts: list[int], k: int) -> bool: ...

    async def collect(self, all_accepted: bool, next_token: int) -> Proposal | None: ...

    async def close(self) -> None: ...


class Drafter:
    def __init__(self, params: GenerationParams, policy: ProposerPolicy, lookup: PromptLookupProposer, stats: RoundStats, *,
                 max_k: int, suffix: SuffixProposer | None = None, draft: DraftModel | None = None,
                 draft_max_context: int = 0, overlap: bool = False, suffix_cache: SuffixCache | None = None,
                 cache_context: int = 0) -> None:
        """max_k: the server's and tiers' cap on K. lookup: always there, the fallback whenever the draft tier is
        unreachable. draft_max_context: the draft's context (beyond it the draft model is not asked).
        overlap: prefetch round r+1 from the draft model while the target verifies round r. suffix_cache:
        the coordinator's tree of recent outputs, which this session's output joins at close(), after
        cache_context prompt tokens."""
        self.params = params
        self.policy = policy
        self.lookup = lookup
        self.stats = stats
        self.max_k = max_k
        self.suffix = suffix
        self.draft = draft
        self.draft_max_context = draft_max_context
        self.overlap = overlap
        self.suffix_cache = suffix_cache
        self.cache_context = cache_context
        self.local = [x for x in (suffix, lookup) if x is not None and params.proposer in (x.source, HYBRID)]
        self._offers: list[Proposal] = []  # the local sources' offers of the round in progress
        self._pending: Proposal | None = None  # the next round's drafts, prefetched during this round's verify
        self._output: list[int] | None = None  # the finished session's tokens, for the shared suffix tree

    async def start(self) -> None:
        if self.suffix is not None:
            await self.suffix.index_prompt(self.params.prompt_ids)

    def budget(self, limit: int) -> int:
        """K for a round that may commit at most `limit` tokens: it yields one token of its own."""
        return min(self.max_k, limit - 1)

    def _max_k(self, budget: int) -> int:
        k = self.params.num_speculative_tokens
        return min(budget, self.policy.config.max_k if k is None else k)

    async def propose(self, committed: list[int], hashes: PrefixHashes, limit: int) -> Proposal:
        """The round's drafts (at most budget(limit) of them) with their q rows."""
        budget = max(self.budget(limit), 0)
        proposal, self._pending = self._pending, None
        if proposal is not None:
            self._offers = []
            self.stats.observe_overlapped(proposal.compute_ms)
        else:
            proposal = await self._choose(committed, hashes, budget)
        if len(proposal.tokens) > budget:
            proposal = dataclasses.replace(proposal, tokens=proposal.tokens[:budget], q=proposal.q[:budget],
                                           probs=proposal.probs[:budget])
        return proposal

    async def _choose(self, committed: list[int], hashes: PrefixHashes, budget: int) -> Proposal:
        max_k = self._max_k(budget)
        draft_ok = (self.draft is not None and self.draft.available
                    and len(committed) + budget <= self.draft_max_context)
        local = self.local if self.local or draft_ok else [self.lookup]  # draft mode, draft down: lookup
        shared = not self.params.reproducible
        offers = [x.propose(max_k, shared) for x in local] if max_k > 0 else []
        fixed = self.params.num_speculative_tokens is not None
        choice = self.policy.choose(offers, max_k, draft_ok, fixed, measured_costs=shared)
        # The draft model is down and backing off: the local proposers stand in.
        fallback = self.draft is not None and not self.draft.available
        if choice.source == DRAFT_MODEL and choice.k > 0:
            try:
                proposal = await self.draft.propose(committed, hashes, choice.k)
                self.stats.observe_rpc(proposal.wall_ms, proposal.compute_ms, proposal.queue_ms, is_draft=True)
                self._offers = offers
                return proposal
            except TierError:  # counted, and the draft left alone for a back-off, by its TierSession
                fallback = True  # the draft is down: the best local offer instead
                offers = offers or [self.lookup.propose(max_k)]
                choice = self.policy.choose(offers, max_k, False, fixed, measured_costs=shared)
        self._offers = offers
        offer = next((o for o in offers if o.source == choice.source), None)
        if offer is None:
            return Proposal(choice.source, [], k=choice.k, fallback=fallback)
        return dataclasses.replace(offer, tokens=offer.tokens[: choice.k], probs=offer.probs[: choice.k], k=choice.k,
                                   fallback=fallback)

    async def verify(self, verifying: Awaitable[Verdict], proposal: Proposal, committed: list[int],
                     hashes: PrefixHashes, limit: int) -> Verdict:
        """The target's verdict on the proposal. With the overlap on and the draft model proposing, the draft
        is asked meanwhile for the next block, assuming every draft is accepted (kept for the next propose()
        if that happens and the draft guessed the bonus token)."""
        drafts = proposal.tokens
        if not (self.overlap and drafts and proposal.source == DRAFT_MODEL and self.draft.available):
            return await verifying
        verify = asyncio.ensure_future(verifying)  # in a task of its own while the draft is asked
        fixed = self.params.num_speculative_tokens
        k_next = min(self.policy.best_draft_k(self._max_k(self.budget(limit))) if fixed is None else fixed,
                     limit - len(drafts) - 2)
        prefetching = False
        if k_next > 0 and len(committed) + len(drafts) + k_next + 1 <= self.draft_max_context:
            prefetching = await self.draft.prefetch(committed, hashes, drafts, k_next)
        try:
            verdict = await verify
        except BaseException:
            verify.cancel()
            raise
        if prefetching:
            self._pending = await self.draft.collect(verdict.num_accepted == len(drafts), verdict.next_token)
        return verdict

    def observe(self, proposal: Proposal, verdict: Verdict, accepted: Sequence[int]) -> None:
        """The round's outcome: accepted = the accepted drafts + the next token."""
        self.policy.observe(proposal, len(proposal.tokens), verdict.num_accepted, verdict.wall_ms)
        if self.params.sampling.temperature == 0:
            self.policy.observe_unchosen(self._offers, proposal.source if proposal.tokens else None, accepted)

    def commit(self, tokens: list[int]) -> None:
        """Tokens just committed."""
        self.lookup.commit(tokens)
        if self.suffix is not None:
            self.suffix.commit(tokens)

    def finish(self, committed: list[int]) -> None:
        """The generation finished with these tokens: its output (after a few prompt tokens) may join the
        shared suffix tree at close()."""
        prompt_len = len(self.params.prompt_ids)
        self._output = committed[prompt_len - min(self.cache_context, prompt_len):]

    async def close(self) -> None:
        """End the draft's session (best effort); a finished generation's output joins the shared suffix tree."""
        if self.draft is not None:
            await self.draft.close()
        if self.suffix_cache is not None and self._output is not None:
            await self.suffix_cache.add_async(self._output)
