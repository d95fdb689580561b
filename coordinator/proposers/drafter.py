"""Drafter: one session's proposers and the policy that picks among them, as the round loop sees them.

propose() is the round's proposal: the policy's pick (coordinator/proposers/policy.py) among the local
sources' offers (suffix tree, prompt lookup) and the draft model (a chain, or a token tree where the draft
tree policy expects more tokens per unit of time: coordinator/proposers/draft_tree.py), cut to the round's
budget. With the speculation cache on (the overlap), the draft tier pre-drafts the next round while the
target verifies, and a round whose outcome it had pre-drafted gets its drafts with no draft latency. If the
draft model is unreachable, the local sources stand in (a fallback round). verify() awaits the target's
verdict. observe() and commit() keep the estimates and the local sources' indexes current."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Sequence
from typing import Protocol

from coordinator.params import GenerationParams
from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_tree import DraftTreePolicy, TreeAsk
from coordinator.proposers.lookup import PromptLookupProposer
from specdec.core.proposer_names import DRAFT_MODEL, HYBRID
from coordinator.proposers.policy import STEADY_CATCH_UP, ProposerPolicy
from coordinator.proposers.suffix import SuffixCache, SuffixProposer
from coordinator.proposers.token_tree import cut
from coordinator.stats import RoundStats
from coordinator.tiers.client import TierError
from coordinator.tiers.target import Verdict
from specdec.core.prefix import PrefixHashes


class DraftModel(Protocol):
    """The draft model as a proposer (coordinator.proposers.draft_model.DraftModelProposer; a fake in tests)."""

    available: bool  # False while the draft tier is left alone after a failure
    trees: DraftTreePolicy | None  # its trees and speculation cache (None: chains only)

    async def propose(self, committed: list[int], hashes: PrefixHashes, k: int, tree: TreeAsk | None = None) -> Proposal: ...

    async def close(self) -> None: ...


class Drafter:
    def __init__(self, params: GenerationParams, policy: ProposerPolicy, lookup: PromptLookupProposer, stats: RoundStats, *,
                 max_k: int, suffix: SuffixProposer | None = None, draft: DraftModel | None = None,
                 draft_max_context: int = 0, suffix_cache: SuffixCache | None = None,
                 cache_context: int = 0, tree_nodes: int = 0) -> None:
        """max_k: the server's and tiers' cap on K. lookup: always there, the fallback whenever the draft tier is
        unreachable. draft_max_context: the draft's context (beyond it the draft model is not asked).
        suffix_cache:
        the coordinator's tree of recent outputs, which this session's output joins at close(), after
        cache_context prompt tokens. tree_nodes > 0: the local sources offer token trees of at most that many
        nodes (K is then their depth), verified as deterministic candidates."""
        self.params = params
        self.policy = policy
        self.lookup = lookup
        self.stats = stats
        self.max_k = max_k
        self.suffix = suffix
        self.draft = draft
        self.draft_max_context = draft_max_context
        self.suffix_cache = suffix_cache
        self.cache_context = cache_context
        self.tree_nodes = min(tree_nodes, max_k)
        self.local = [x for x in (suffix, lookup) if x is not None and params.proposer in (x.source, HYBRID)]
        self._offers: list[Proposal] = []  # the local sources' offers of the round in progress
        self._draft_ms = 0.0  # the draft model's proposals' wall time when not pre-drafted (weighted)
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
        proposal = await self._choose(committed, hashes, budget)
        if proposal.overlapped:  # the draft's speculation cache had it ready: a draft call's time saved
            self.stats.observe_overlapped(0.0, saved_ms=max(0.0, self._draft_ms - proposal.wall_ms))
        elif proposal.source == DRAFT_MODEL and proposal.tokens:
            self._draft_ms = 0.8 * self._draft_ms + 0.2 * proposal.wall_ms if self._draft_ms else proposal.wall_ms
        if proposal.parents and proposal.source != DRAFT_MODEL:  # a local tree: no deeper than the budget
            tokens, parents, probs = cut(proposal.tokens, proposal.parents, proposal.probs, budget, self.max_k)
            proposal = dataclasses.replace(proposal, tokens=tokens, parents=parents, probs=probs)
        elif not proposal.parents and len(proposal.tokens) > budget:
            proposal = dataclasses.replace(proposal, tokens=proposal.tokens[:budget], q=proposal.q[:budget],
                                           probs=proposal.probs[:budget])
        return proposal  # a draft-model tree was asked within the budget (depth <= K, nodes <= max_k)

    async def _choose(self, committed: list[int], hashes: PrefixHashes, budget: int) -> Proposal:
        max_k = self._max_k(budget)
        fixed = self.params.num_speculative_tokens is not None
        draft_ok = (self.draft is not None and self.draft.available
                    and len(committed) + budget <= self.draft_max_context)
        local = self.local if self.local or draft_ok else [self.lookup]  # draft mode, draft down: lookup
        draft_ok = draft_ok and self.policy.draft_allowed(fixed)  # not while the target is crowded (shared cores)
        shared = not self.params.reproducible
        offers = [x.propose(max_k, shared, self.tree_nodes) for x in local] if max_k > 0 else []
        trees = self.draft.trees if draft_ok else None
        choice = self.policy.choose(offers, max_k, draft_ok, fixed, measured_costs=shared, trees=trees, max_nodes=self.max_k)
        # The draft model is down and backing off: the local proposers stand in.
        fallback = self.draft is not None and not self.draft.available
        if choice.source == DRAFT_MODEL and choice.k > 0:
            tree = choice.tree
            if fixed and trees is not None:  # the request's K: the tree of that depth, whatever the timings
                tree = trees.fixed(choice.k, self.policy.estimates[DRAFT_MODEL].acceptance, self.max_k)
            try:
                proposal = await self.draft.propose(committed, hashes, choice.k, tree)
                self.stats.observe_rpc(proposal.wall_ms, proposal.compute_ms, proposal.queue_ms, is_draft=True)
                self._offers = offers
                return proposal
            except TierError:  # counted, and the draft left alone for a back-off, by its TierSession
                fallback = True  # the draft is down: the best local offer instead
                offers = offers or [self.lookup.propose(max_k, tree_nodes=self.tree_nodes)]
                choice = self.policy.choose(offers, max_k, False, fixed, measured_costs=shared)
        self._offers = offers
        offer = next((o for o in offers if o.source == choice.source), None)
        if offer is None:
            return Proposal(choice.source, [], k=choice.k, fallback=fallback)
        return dataclasses.replace(offer, tokens=offer.tokens[: choice.k], probs=offer.probs[: choice.k], k=choice.k,
                                   parents=offer.parents[: choice.k], fallback=fallback)  # a tree: its first k nodes

    async def verify(self, verifying: Awaitable[Verdict], proposal: Proposal, committed: list[int],
                     hashes: PrefixHashes, limit: int) -> Verdict:
        """The target's verdict on the proposal. The draft tier pre-drafts the next round meanwhile on its own
        (its speculation cache, asked for in the proposal's request), so nothing is sent here."""
        return await verifying

    def observe(self, proposal: Proposal, verdict: Verdict, accepted: Sequence[int]) -> None:
        """The round's outcome: accepted = the accepted drafts + the next token."""
        if proposal.parents and proposal.source == DRAFT_MODEL and self.draft.trees is not None:
            self.draft.trees.observe(proposal.parents, verdict.path,  # which sibling held at each level; the time
                                     0.0 if proposal.overlapped else proposal.wall_ms + verdict.wall_ms)
            self.policy.verify_cost.observe(len(proposal.tokens), verdict.wall_ms)  # verify against nodes scored
            if proposal.catch_up <= STEADY_CATCH_UP:  # one draft step per level, as a chain's K
                self.policy.estimates[DRAFT_MODEL].propose_cost.observe(proposal.k, proposal.wall_ms)
        else:
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
        """End the draft's session (best effort); a finished generation's output joins the shared suffix tree,
        and what its rounds taught the policy joins the coordinator's priors."""
        self.policy.teach()
        if self.draft is not None and self.draft.trees is not None:
            self.draft.trees.teach(self.policy.estimates[DRAFT_MODEL].acceptance)
        if self.draft is not None:
            await self.draft.close()
        if self.suffix_cache is not None and self._output is not None:
            await self.suffix_cache.add_async(self._output)
