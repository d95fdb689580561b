"""Prompt lookup (n-gram) drafting over a session's own tokens, as transformers' prompt_lookup_num_tokens and
vLLM's ngram method: the continuation of the latest earlier occurrence of the last n tokens, n from max_n down
to min_n (ngram_index.py); deterministic, so its q is one-hot. docs/DESIGN.md, Proposers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import SharedPriors
from coordinator.proposers.local import LocalStrategy
from coordinator.proposers.ngram_index import NgramIndex
from specdec.core.proposer_names import PROMPT_LOOKUP


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup."""

    min_ngram: int = 2  # shortest suffix worth matching (1-grams match too often to be accepted)
    max_ngram: int = 4  # longest suffix tried first
    prior_acceptance: float = 0.5  # per-token acceptance assumed before any round (and before any session taught one)
    decay: float = 0.9  # weight of the past per round in its estimates (~10-round memory)
    watch: int = 2  # sessions with no taught prior: drafts judged against the committed tokens before the first drafted


class LookupStrategy(LocalStrategy):
    """Prompt lookup as a strategy (coordinator.proposers.local): the session's n-gram index."""

    source = PROMPT_LOOKUP

    def __init__(self, config: LookupConfig, prompt_ids: list[int], *, greedy: bool = True, tree_nodes: int = 0,
                 priors: SharedPriors | None = None) -> None:
        super().__init__(config.prior_acceptance, config.decay, greedy=greedy, tree_nodes=tree_nodes, priors=priors,
                         watch=config.watch)
        self.index = NgramIndex(config)
        self.prompt_ids = prompt_ids
        self.ready = not prompt_ids  # until the prompt is indexed (never, for a request that never drafts)

    async def start(self) -> None:
        """Index the prompt (~1 us a token)."""
        self.index.extend(self.prompt_ids)
        self.ready = True

    def commit(self, tokens) -> None:
        self.index.extend(tokens)

    def offer(self, k: int, tree_nodes: int = 0) -> Proposal:
        t0 = time.perf_counter()
        if tree_nodes > 0:
            tokens, parents = self.index.propose_tree(k, tree_nodes)
        else:
            tokens, parents = self.index.propose(k), []
        return Proposal(PROMPT_LOOKUP, tokens, wall_ms=(time.perf_counter() - t0) * 1e3, k=k, parents=parents)
