"""The coordinator's shared suffix tree: recent finished outputs of all its sessions, which suffix decoding
(coordinator/proposers/suffix.py) matches besides each session's own tree. The tree and its proposals are
coordinator/proposers/suffix_tree.py's."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from coordinator.proposers.suffix_tree import SuffixConfig, SuffixDraft, SuffixTree, speculate


class SuffixCache:
    """Recent finished outputs of every session in one suffix tree, shared by a coordinator's
    sessions. Bounded by entries and by estimated bytes; the oldest output is evicted first."""

    CHUNK = 256  # tokens inserted between yields to the event loop

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.tree = SuffixTree(config.max_depth)
        self._entries: OrderedDict[int, None] = OrderedDict()  # sequence ids, oldest first
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.config.cache_entries > 0 and self.config.cache_bytes > 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def estimated_bytes(self) -> int:
        return self.tree.estimated_bytes

    def add(self, tokens) -> None:
        """Cache one finished output now (O(n D), blocking)."""
        seq_id = self._start()
        if seq_id is not None:
            self.tree.extend(seq_id, tokens)
            self._finish(seq_id)

    async def add_async(self, tokens) -> None:
        """Cache one finished output, yielding to the event loop every CHUNK tokens."""
        seq_id = self._start()
        if seq_id is None:
            return
        tokens = list(tokens)
        for i in range(0, len(tokens), self.CHUNK):
            if seq_id not in self._entries:
                return  # evicted meanwhile (clear())
            self.tree.extend(seq_id, tokens[i : i + self.CHUNK])
            await asyncio.sleep(0)
        if seq_id in self._entries:
            self._finish(seq_id)

    def speculate(self, context, max_tokens: int) -> SuffixDraft:
        return speculate(self.tree, context, max_tokens, self.config)

    def clear(self) -> None:
        for seq_id in list(self._entries):
            self._evict(seq_id)

    def _start(self) -> int | None:
        if not self.enabled:
            return None
        seq_id = self._next_id
        self._next_id += 1
        self._entries[seq_id] = None
        return seq_id

    def _finish(self, seq_id: int) -> None:
        self.tree.close(seq_id)
        c = self.config
        while self._entries and (len(self._entries) > c.cache_entries or self.tree.estimated_bytes > c.cache_bytes):
            self._evict(next(iter(self._entries)))  # the oldest; the new one too if it alone is too big

    def _evict(self, seq_id: int) -> None:
        del self._entries[seq_id]
        self.tree.remove(seq_id)
