"""The session table: which KV slot holds which session, and what it holds.

Each entry maps a session id to its slot, the token ids whose keys and values the slot holds, and their
prefix fingerprints. The coordinator owns the committed sequence; a tier only ever crops a session
back to a prefix the coordinator names and appends committed tokens, so any idle session may be
evicted at any time without losing data (the coordinator resends). A session with work in flight is
busy and never evicted: when every slot is busy, new sessions wait in the engine's queue.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.engine.kv_cache import SlotKVCache
from specdec.core.prefix import PrefixHashes


class PrefixMismatch(Exception):
    """The tier does not hold the prefix a request names (-> FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SessionStoreConfig:
    max_sessions: int = 64  # KV slots, i.e. live sessions; an idle one is evicted (LRU) for a new one
    max_session_tokens: int = 2048  # tokens one slot holds (capped by the model's context)
    max_cached_tokens: int = 1_000_000  # tokens across all sessions; idle sessions evicted (LRU) beyond it
    idle_ttl_s: float = 600.0  # a session unused this long is evicted
    kv_memory_gib: float = 0.0  # > 0: size the KV pool from this budget (slots of max_session_tokens) instead of max_sessions


@dataclass
class Session:
    session_id: str
    slot: int
    tokens: list[int] = field(default_factory=list)  # ids whose KV entries the slot holds
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of tokens' prefixes
    last_used: float = 0.0
    busy: bool = False  # work in flight: never evicted
    ended: bool = False  # EndSession arrived while busy: free it when the work is done

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def crop(self, length: int) -> None:
        """Forget tokens past `length`: a length change; the slot's stale entries get overwritten."""
        del self.tokens[length:]
        self.hashes.crop(length)


class SessionTable:
    """LRU map session_id -> Session over the slots of a SlotKVCache, bounded by slots, cached
    tokens and idle time."""

    def __init__(self, config: SessionStoreConfig, cache: SlotKVCache, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evictions = 0
        self.cached_tokens = 0  # kept up to date by append / crop / free

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def acquire(self, session_id: str, prefix_len: int, prefix_hash: int) -> Session | None:
        """The session cropped to its first prefix_len tokens and marked busy, ready for new tokens.

        prefix_len == 0 starts the session afresh (creating it if needed). Otherwise the session must
        exist, hold at least prefix_len tokens and match prefix_hash, or PrefixMismatch is raised.
        Returns None when a new session needs a slot and every slot is busy (the caller waits).
        """
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        self.evict_idle()
        session = self._sessions.get(session_id)
        if prefix_len > 0:
            if session is None:
                raise PrefixMismatch(f"session {session_id!r} is not cached here; resend from the start")
            if len(session) < prefix_len:
                raise PrefixMismatch(f"session {session_id!r} holds {len(session)} tokens, fewer than prefix_len={prefix_len}")
            if session.hashes.at(prefix_len) != prefix_hash:
                raise PrefixMismatch(f"session {session_id!r}: prefix fingerprint differs at prefix_len={prefix_len}")
        elif session is None:
            slot = self._free_slot()
            if slot is None:
                return None
            session = Session(session_id=session_id, slot=slot)
            self._sessions[session_id] = session
        self.crop(session, prefix_len)
        session.last_used = self._clock()
        session.busy = True
        self._sessions.move_to_end(session_id)
        return session

    def append(self, session: Session, tokens: list[int]) -> None:
        session.append(tokens)
        self.cached_tokens += len(tokens)

    def crop(self, session: Session, length: int) -> None:
        if len(session) > length:
            self.cached_tokens -= len(session) - length
            session.crop(length)

    def release(self, session: Session) -> None:
        """The session's work is done: free it if it was ended meanwhile, then apply the token budget
        (never evicting a busy session)."""
        session.busy = False
        session.last_used = self._clock()
        if session.ended:
            self._free(session.session_id)
            return
        if self.cached_tokens > self.config.max_cached_tokens:
            for sid in [s.session_id for s in self._sessions.values() if not s.busy and s is not session]:
                if self.cached_tokens <= self.config.max_cached_tokens:
                    break
                self._free(sid)
                self.evictions += 1

    def remove(self, session_id: str) -> bool:
        """EndSession: free now, or when its work in flight is done."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        if session.busy:
            session.ended = True
        else:
            self._free(session_id)
        return True

    def drop(self, session: Session) -> None:
        """Forget a session whose cache is unusable (a failed or half-fed step)."""
        if self._sessions.get(session.session_id) is session:
            self._free(session.session_id)

    def evict_idle(self) -> int:
        deadline = self._clock() - self.config.idle_ttl_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.busy]
        for sid in stale:
            self._free(sid)
        self.evictions += len(stale)
        return len(stale)

    def _free_slot(self) -> int | None:
        slot = self.cache.allocate()
        if slot is None:
            idle = next((sid for sid, s in self._sessions.items() if not s.busy), None)  # least recently used
            if idle is None:
                return None
            self._free(idle)
            self.evictions += 1
            slot = self.cache.allocate()
        return slot

    def _free(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        self.cached_tokens -= len(session)
        self.cache.release(session.slot)
