"""Prompt lookup (n-gram) drafting over a session's own tokens.

Propose the continuation of the most recent earlier occurrence of the sequence's last n tokens,
trying n from max_n down to min_n (as transformers' prompt_lookup_num_tokens and vLLM's ngram method
do). The proposal is deterministic, so its q is one-hot and needs no transfer.

An incremental index (one dict per n: n-gram -> where its latest earlier occurrences end, the last
MATCHES of them) makes a lookup O(max_n) and each committed token O(max_n - min_n + 1), independent of the
context length. As a token tree (tree_nodes > 0) the proposal offers several matches' continuations as
sibling branches: the latest match of the longest n-gram first (the chain), then the other occurrences,
longest n-gram first, most recent first, within the node budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import SharedPriors
from coordinator.proposers.local import LocalStrategy
from specdec.core.proposer_names import PROMPT_LOOKUP
from coordinator.proposers.token_tree import TreeBuilder

MATCHES = 4  # occurrences kept per n-gram (the branches a tree may offer from one n)


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup."""

    min_ngram: int = 2  # shortest suffix worth matching (1-grams match too often to be accepted)
    max_ngram: int = 4  # longest suffix tried first
    prior_acceptance: float = 0.5  # per-token acceptance assumed before any round (and before any session taught one)
    decay: float = 0.9  # weight of the past per round in its estimates (~10-round memory)


class NgramIndex:
    def __init__(self, config: LookupConfig, tokens: list[int] = ()) -> None:
        if not 1 <= config.min_ngram <= config.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {config.min_ngram}, {config.max_ngram}")
        self.config = config
        self.tokens: list[int] = []
        # n -> n-gram -> where its latest occurrences end (oldest first)
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(t)
            # The n-gram ending just before the new token now has a continuation (the new token).
            end = len(seq) - 1
            for n, index in self._index.items():
                if end >= n:
                    ends = index.setdefault(tuple(seq[end - n : end]), [])
                    ends.append(end)
                    if len(ends) > MATCHES:
                        del ends[0]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the latest earlier match of the longest matching suffix."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            ends = self._index[n].get(tuple(seq[-n:]))
            if ends:
                return seq[ends[-1] : ends[-1] + k]
        return []

    def propose_tree(self, k: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(tokens, parents): the continuations (up to k tokens each) of every kept occurrence of every
        matching suffix, merged into one tree of at most max_nodes nodes, the chain propose(k) first."""
        seq = self.tokens
        tree = TreeBuilder(max_nodes)
        if k <= 0:
            return [], []
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            for end in reversed(self._index[n].get(tuple(seq[-n:]), ())):
                tree.add_branch(seq[end : end + k])
                if tree.full:
                    return tree.tokens, tree.parents
        return tree.tokens, tree.parents


class LookupStrategy(LocalStrategy):
    """Prompt lookup as a strategy (coordinator.proposers.local): the session's n-gram index."""

    source = PROMPT_LOOKUP

    def __init__(self, config: LookupConfig, prompt_ids: list[int], *, greedy: bool = True, tree_nodes: int = 0,
                 priors: SharedPriors | None = None) -> None:
        super().__init__(config.prior_acceptance, config.decay, greedy=greedy, tree_nodes=tree_nodes, priors=priors)
        self.index = NgramIndex(config, prompt_ids)

    def commit(self, tokens) -> None:
        self.index.extend(tokens)

    def offer(self, k: int, tree_nodes: int = 0) -> Proposal:
        t0 = time.perf_counter()
        if tree_nodes > 0:
            tokens, parents = self.index.propose_tree(k, tree_nodes)
        else:
            tokens, parents = self.index.propose(k), []
        return Proposal(PROMPT_LOOKUP, tokens, wall_ms=(time.perf_counter() - t0) * 1e3, k=k, parents=parents)
