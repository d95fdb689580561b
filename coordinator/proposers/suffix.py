"""Suffix decoding as a strategy: chains (or token trees) from the session's own suffix tree and the shared one
of recent outputs (suffix_cache.py), each draft with the tree's estimate of its chance (docs/DESIGN.md,
Proposers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import SharedPriors
from coordinator.proposers.local import LocalStrategy
from specdec.core.proposer_names import SUFFIX
from coordinator.proposers.suffix_cache import SuffixCache
from coordinator.proposers.suffix_tree import SuffixConfig, SuffixTree, speculate, token_tree

__all__ = ["SuffixCache", "SuffixConfig", "SuffixStrategy", "SuffixTree", "speculate"]


class SuffixStrategy(LocalStrategy):
    source = SUFFIX
    SEQ = 0  # the session's one sequence in its own tree
    CHUNK = 512  # prompt tokens indexed between yields to the event loop

    def __init__(self, config: SuffixConfig, cache: SuffixCache | None, prompt_ids: Sequence[int] = (), *,
                 greedy: bool = True, tree_nodes: int = 0, priors: SharedPriors | None = None) -> None:
        """cache: the shared tree, which this session's output joins at close()."""
        super().__init__(config.prior_acceptance, config.decay, greedy=greedy, tree_nodes=tree_nodes, priors=priors,
                         watch=config.watch)
        self.config, self.prompt_ids = config, list(prompt_ids)
        self.cache = cache if cache is not None and cache.enabled else None
        self.tree = SuffixTree(config.max_depth)
        self.tree.extend(self.SEQ, ())
        self.ready = not self.prompt_ids  # until the prompt is indexed

    async def start(self) -> None:
        """Index the prompt (O(len D), ~2 us a token on chat text), yielding to the event loop now and then."""
        for i in range(0, len(self.prompt_ids), self.CHUNK):
            self.tree.extend(self.SEQ, self.prompt_ids[i : i + self.CHUNK])
            if len(self.prompt_ids) > self.CHUNK:
                await asyncio.sleep(0)
        self.ready = True

    def commit(self, tokens) -> None:
        self.tree.extend(self.SEQ, tokens)

    def offer(self, k: int, tree_nodes: int = 0) -> Proposal:
        """The better-scoring chain of the session's own tree and the shared one; tree_nodes > 0: that chain's
        match expanded into a token tree of at most tree_nodes nodes (and depth k)."""
        t0 = time.perf_counter()
        seq = self.tree.seqs[self.SEQ]
        matches: list = []
        best = speculate(self.tree, seq, k, self.config, seq_id=self.SEQ, matches=matches if tree_nodes > 0 else None)
        if self.cache is not None and self.cache.entries:
            others: list = []
            shared = speculate(self.cache.tree, seq[-(self.config.max_depth - 1) :], k, self.cache.config,
                               matches=others if tree_nodes > 0 else None)
            if shared.score > best.score:
                best, matches = shared, others
        if tree_nodes > 0 and best.spot is not None:
            tokens, parents, probs = token_tree(best, matches, tree_nodes, self.config.min_token_prob)
            return Proposal(SUFFIX, tokens, probs=probs, parents=parents, wall_ms=(time.perf_counter() - t0) * 1e3)
        return Proposal(SUFFIX, best.tokens, probs=best.probs, wall_ms=(time.perf_counter() - t0) * 1e3)
