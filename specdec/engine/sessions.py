"""Session-keyed KV cache store, shared by the draft and target tiers.

Each entry holds a model's KV cache, the token ids whose keys/values it holds, and their prefix
fingerprints. The coordinator owns the committed sequence; a tier only ever crops its cache back to
a prefix the coordinator names and appends committed tokens, so any entry may be evicted at any time
without losing data (the coordinator resends).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.wire.prefix import PrefixHashes


class PrefixMismatch(Exception):
    """The tier does not hold the prefix a request names (-> FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SessionStoreConfig:
    max_sessions: int = 256  # live sessions; the least recently used is evicted beyond this
    max_cached_tokens: int = 1_000_000  # tokens across all caches; LRU eviction beyond this
    idle_ttl_s: float = 600.0  # a session unused this long is evicted


@dataclass
class Session:
    session_id: str
    cache: Any  # the model's KV cache object (e.g. transformers DynamicCache)
    tokens: list[int] = field(default_factory=list)  # ids whose KV entries the cache holds
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of tokens' prefixes
    last_used: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def crop(self, length: int) -> None:
        """Forget tokens past `length` (the caller crops the KV cache itself)."""
        del self.tokens[length:]
        self.hashes.crop(length)


class SessionStore:
    """LRU map session_id -> Session, bounded by count, cached tokens and idle time."""

    def __init__(
        self,
        config: SessionStoreConfig,
        new_cache: Callable[[], Any],
        crop_cache: Callable[[Any, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._new_cache = new_cache
        self._crop_cache = crop_cache
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def cached_tokens(self) -> int:
        return sum(len(s) for s in self._sessions.values())

    def acquire(self, session_id: str, prefix_len: int, prefix_hash: int) -> Session:
        """The session cropped to its first `prefix_len` tokens, ready for new committed tokens.

        prefix_len == 0 starts the session afresh (creating it if needed). Otherwise the session must
        exist, hold at least prefix_len tokens and match prefix_hash, or PrefixMismatch is raised.
        """
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        self.evict_idle()
        session = self._sessions.get(session_id)
        if prefix_len > 0:
            if session is None:
                raise PrefixMismatch(f"session {session_id!r} is not cached here; resend from the start")
            if len(session) < prefix_len:
                raise PrefixMismatch(
                    f"session {session_id!r} holds {len(session)} tokens, fewer than prefix_len={prefix_len}"
                )
            if session.hashes.at(prefix_len) != prefix_hash:
                raise PrefixMismatch(
                    f"session {session_id!r}: prefix fingerprint differs at prefix_len={prefix_len}"
                )
        elif session is None:
            session = Session(session_id=session_id, cache=self._new_cache())
            self._sessions[session_id] = session
        self._crop(session, prefix_len)
        session.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        return session

    def crop(self, session: Session, length: int) -> None:
        """Crop a session's cache and token list to `length` tokens."""
        self._crop(session, length)

    def _crop(self, session: Session, length: int) -> None:
        if len(session) > length:
            self._crop_cache(session.cache, length)
            session.crop(length)

    def release(self, session: Session) -> None:
        """Call after appending tokens: applies the capacity bounds (never evicting `session`)."""
        self._evict_over_capacity(keep=session.session_id)

    def remove(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def evict_idle(self) -> int:
        deadline = self._clock() - self.config.idle_ttl_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < deadline]
        for sid in stale:
            del self._sessions[sid]
        self.evictions += len(stale)
        return len(stale)

    def _evict_over_capacity(self, keep: str) -> None:
        total = self.cached_tokens
        while self._sessions and (
            len(self._sessions) > self.config.max_sessions or total > self.config.max_cached_tokens
        ):
            oldest_id = next(iter(self._sessions))
            if oldest_id == keep:
                if len(self._sessions) == 1:
                    break
                self._sessions.move_to_end(keep)
                continue
            total -= len(self._sessions.pop(oldest_id))
            self.evictions += 1
