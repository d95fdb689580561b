"""What the coordinator knows of a tier's cache for a session (TierCursor), and the hypothetical
continuations it asks about (Extended)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2


class Extended(Sequence[int]):
    """base + extra as one read-only sequence without copying base (the committed tokens): a
    hypothetical continuation, for TierCursor.context."""

    __slots__ = ("_base", "_extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self._base, self._extra = base, extra

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    def __getitem__(self, i):
        n = len(self._base)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            head = list(self._base[start:min(stop, n)]) if start < n else []
            return head + list(self._extra[max(start - n, 0):max(stop - n, 0)])
        if i < 0:
            i += len(self)
        return self._base[i] if i < n else self._extra[i - n]


class TierCursor:
    """Which tokens one tier caches for a session, as far as the coordinator knows.

    The tier caches committed[:base] followed by `tail`: tokens it fed that were not known to be
    committed when sent (the draft's own proposals, the target's accepted drafts, a speculative
    context). Once rounds are committed, the leading tail tokens that match are reusable.
    """

    __slots__ = ("base", "tail", "_lost", "_on_reprefill")

    def __init__(self, on_reprefill: Callable[[], None] | None = None) -> None:
        """on_reprefill: called on the first reply after a reset() that dropped a cache, i.e. once the tier
        has the whole sequence again (a re-prefill: the tier had lost or was assumed to have lost it)."""
        self.base = 0
        self.tail: list[int] = []
        self._lost = False
        self._on_reprefill = on_reprefill

    def reset(self, lost: bool = True) -> None:
        """Send the whole sequence next time: the tier lost it (or may have), or (lost False) the next request must
        feed it all again for what it asks of every position."""
        self._lost = self._lost or (lost and (self.base > 0 or bool(self.tail)))
        self.base, self.tail = 0, []

    def prefix(self, sequence: list[int]) -> int:
        """How many leading tokens of `sequence` a request need not send: those the tier caches, all but the
        last at most (the tier needs the last token's logits)."""
        n = self.base
        for tok in self.tail:
            if n >= len(sequence) or sequence[n] != tok:
                break
            n += 1
        return min(n, len(sequence) - 1)

    def context(self, session_id: str, sequence: list[int], hashes: PrefixHashes) -> common_pb2.SessionContext:
        """The context for a request over `sequence` (the committed tokens, or a hypothetical
        extension of them); `hashes` must cover `sequence`."""
        prefix = self.prefix(sequence)
        return common_pb2.SessionContext(
            session_id=session_id, prefix_len=prefix, prefix_hash=hashes.at(prefix), new_tokens=sequence[prefix:]
        )

    def update(self, ctx: common_pb2.SessionContext, extra: list[int], cached_len: int, committed_len: int) -> None:
        """Record a reply: the tier caches cached_len tokens of (context sequence + extra), of which
        only the first committed_len are known to be committed."""
        if self._lost and ctx.prefix_len == 0:
            self._lost = False
            if self._on_reprefill is not None:
                self._on_reprefill()
        self.base = min(cached_len, committed_len, ctx.prefix_len + len(ctx.new_tokens))
        after_prefix = list(ctx.new_tokens) + list(extra)
        self.tail = after_prefix[self.base - ctx.prefix_len : cached_len - ctx.prefix_len]
