"""The n-gram index prompt lookup reads (coordinator/proposers/lookup.py): per n, each n-gram -> where its latest
MATCHES earlier occurrences end, so a lookup is O(max_n) and a committed token O(max_n - min_n + 1), whatever the
context's length. A chain continues the latest match of the longest n-gram; a tree merges every kept match's
continuation, longest n-gram first, most recent first."""

from __future__ import annotations

from coordinator.proposers.token_tree import TreeBuilder

MATCHES = 4  # occurrences kept per n-gram (the branches a tree may offer from one n)


class NgramIndex:
    def __init__(self, config, tokens: list[int] = ()) -> None:
        """config: a LookupConfig (its min_ngram and max_ngram); tokens: the sequence so far."""
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
