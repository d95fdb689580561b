"""The prefix cache's index: which sessions' slots hold which token prefixes, at block granularity.

Every session's prefixes whose length is a multiple of block_tokens are indexed by their fingerprint
(specdec.core.prefix: the session already computes the fingerprint of every prefix length), kept exact
as the session grows (extend) and shrinks (crop: a rejected draft, a restart). A new request looks up
its own block-aligned prefixes, longest first (candidates); the session table then checks the holder's
tokens themselves (a fingerprint is only a hint) and extends the match token by token past the last
block. The index holds no KV and no tokens: the slots do (DESIGN.md, "Sessions and KV memory").
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from specdec.core.prefix import PrefixHashes


class PrefixIndex:
    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._holders: dict[int, dict[Hashable, None]] = {}  # fingerprint -> holders (an ordered set)
        self._held: dict[Hashable, dict[int, int]] = {}  # holder -> {prefix length: fingerprint}, ascending

    def __len__(self) -> int:
        """Indexed (holder, block-aligned prefix) pairs."""
        return sum(len(h) for h in self._held.values())

    def extend(self, holder: Hashable, hashes: PrefixHashes, old_len: int) -> None:
        """The holder grew from old_len to len(hashes) tokens: index the block boundaries it crossed."""
        b = self.block_tokens
        held = self._held.setdefault(holder, {})
        for length in range((old_len // b + 1) * b, len(hashes) + 1, b):
            fingerprint = hashes.at(length)
            held[length] = fingerprint
            self._holders.setdefault(fingerprint, {})[holder] = None

    def crop(self, holder: Hashable, length: int) -> None:
        """The holder keeps only its first `length` tokens."""
        held = self._held.get(holder)
        while held and next(reversed(held)) > length:
            n, fingerprint = held.popitem()
            holders = self._holders[fingerprint]
            holders.pop(holder, None)
            if not holders:
                del self._holders[fingerprint]

    def remove(self, holder: Hashable) -> None:
        self.crop(holder, 0)
        self._held.pop(holder, None)

    def candidates(self, hashes: PrefixHashes, limit: int) -> Iterator[tuple[int, list[Hashable]]]:
        """(length, holders) for each block-aligned prefix of at most `limit` tokens that someone holds,
        longest first. `hashes` covers the request's tokens up to at least `limit`."""
        b = self.block_tokens
        for length in range(limit // b * b, 0, -b):
            holders = self._holders.get(hashes.at(length))
            if holders:
                yield length, list(holders)
