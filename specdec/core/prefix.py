"""Rolling fingerprints of committed token prefixes.

hashes[i] fingerprints tokens[: i + 1]. A tier compares the coordinator's hash at prefix_len with its
own to prove that the cache it holds is the prefix the coordinator means (DESIGN.md, sessions).
"""

from __future__ import annotations

from collections.abc import Iterable

from specdec.math.seeds import GOLDEN_GAMMA, mix64

_MASK64 = (1 << 64) - 1


def _mix(h: int, token: int) -> int:
    # (h, token) -> next fingerprint: order sensitive; never 0, which stands for the empty prefix.
    return mix64(h ^ ((token + GOLDEN_GAMMA) & _MASK64)) or 1


class PrefixHashes:
    """Fingerprints of every prefix of a growing, croppable token sequence."""

    __slots__ = ("_hashes",)

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._hashes: list[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._hashes)

    def extend(self, tokens: Iterable[int]) -> None:
        h = self._hashes[-1] if self._hashes else 0
        for t in tokens:
            h = _mix(h, t)
            self._hashes.append(h)

    def extended(self, tokens: Iterable[int]) -> "ExtendedHashes":
        """Fingerprints that also cover `tokens` (a hypothetical continuation), without copying these."""
        return ExtendedHashes(self, tokens)

    def crop(self, length: int) -> None:
        del self._hashes[length:]

    def at(self, length: int) -> int:
        """Fingerprint of the first `length` tokens (0 for the empty prefix)."""
        return self._hashes[length - 1] if length > 0 else 0


class ExtendedHashes:
    """PrefixHashes of base + tokens, over `base` itself (O(len(tokens)), not O(context)); read-only."""

    __slots__ = ("_base", "_extra")

    def __init__(self, base: PrefixHashes, tokens: Iterable[int]) -> None:
        self._base = base
        self._extra: list[int] = []
        h = base.at(len(base))
        for t in tokens:
            h = _mix(h, t)
            self._extra.append(h)

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    def at(self, length: int) -> int:
        n = len(self._base)
        return self._base.at(length) if length <= n else self._extra[length - n - 1]
