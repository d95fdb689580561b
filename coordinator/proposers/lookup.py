"""Prompt lookup (n-gram) drafting over a session's own tokens.

Propose the continuation of the most recent earlier occurrence of the sequence's last n tokens,
trying n from max_n down to min_n (as transformers' prompt_lookup_num_tokens and vLLM's ngram method
do). The proposal is deterministic, so its q is one-hot and needs no transfer.

An incremental index (one dict per n: n-gram -> where its latest earlier occurrence ends) makes a
lookup O(max_n) and each committed token O(max_n - min_n + 1), independent of the context length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.proposers.base import Proposal
from coordinator.proposers.names import PROMPT_LOOKUP


@dataclass(frozen=True)
class LookupConfig:
    min_ngram: int = 2  # shortest suffix worth matching (1-grams match too often to be accepted)
    max_ngram: int = 4  # longest suffix tried first


class NgramIndex:
    def __init__(self, config: LookupConfig, tokens: list[int] = ()) -> None:
        if not 1 <= config.min_ngram <= config.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {config.min_ngram}, {config.max_ngram}")
        self.config = config
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(t)
            # The n-gram ending just before the new token now has a continuation (the new token).
            end = len(seq) - 1
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(seq[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the latest earlier match of the longest matching suffix."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            end = self._index[n].get(tuple(seq[-n:]))
            if end is not None:
                return seq[end : end + k]
        return []


class PromptLookupProposer:
    source = PROMPT_LOOKUP

    def __init__(self, config: LookupConfig, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(config, prompt_ids)

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def propose(self, k: int, shared: bool = True) -> Proposal:
        """Up to k tokens; `shared` is for the suffix proposer's interface (lookup has no shared state)."""
        t0 = time.perf_counter()
        tokens = self.index.propose(k)
        return Proposal(PROMPT_LOOKUP, tokens, wall_ms=(time.perf_counter() - t0) * 1e3, k=k)
