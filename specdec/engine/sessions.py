"""The session table: which KV slot holds which session, and what it holds.

Each entry maps a session id to its slot, the token ids whose keys and values the slot holds, and their
prefix fingerprints. The coordinator owns the committed sequence; a tier only ever crops a session
back to a prefix the coordinator names and appends committed tokens, so any idle session may be
evicted at any time without losing data (the coordinator resends). A session with work in flight is
busy and never evicted: when every slot is busy, new sessions wait in the engine's queue.

The prefix cache: a session that ends (EndSession, its stream closed) keeps its slot as a *retained*
entry, evicted LRU with the idle sessions under the same slot and token bounds. A request that starts a
session afresh (prefix_len == 0, the whole sequence sent) takes the longest prefix of its tokens that
any slot holds (PrefixIndex: block-aligned fingerprints, then the tokens compared): it adopts a
retained slot whole (the next turn of a conversation continues in its last turn's slot) or copies the
prefix's KV from a live session's slot (a memcpy per layer, no forward), and feeds only the rest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from specdec.core.prefix import PrefixHashes
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.prefix_index import PrefixIndex


class PrefixMismatch(Exception):
    """The tier does not hold the prefix a request names (-> FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SessionStoreConfig:
    """Sessions and KV memory."""

    max_sessions: int = 64  # KV slots (live sessions); an idle session is evicted (LRU) for a new one
    max_session_tokens: int = 2048  # tokens one KV slot holds (capped by the model's context)
    max_cached_tokens: int = 1_000_000  # tokens cached across sessions; idle sessions are evicted (LRU) beyond it
    idle_ttl_s: float = 600.0  # seconds before an unused session is evicted
    kv_memory_gib: float = 0.0  # > 0: size the KV pool from this memory budget (slots of --max-session-tokens) instead of --max-sessions
    prefix_cache: bool = True  # keep ended sessions' KV slots and start a new session from the longest cached prefix of its tokens
    prefix_block_tokens: int = 16  # prefix-cache granularity: prefixes are indexed every this many tokens (a match then extends token by token)


@dataclass(eq=False)
class Session:
    session_id: str
    slot: int
    tokens: list[int] = field(default_factory=list)  # ids whose KV entries the slot holds
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of tokens' prefixes
    last_used: float = 0.0
    busy: bool = False  # work in flight: never evicted
    ended: bool = False  # EndSession arrived while busy: free (or retain) it when the work is done
    retained: bool = False  # ended, kept only as a prefix-cache donor (session_id no longer names it)
    reused: int = 0  # tokens its last fresh start took from the prefix cache
    # The draft tier's KV entries past `tokens` (its last token tree's fed nodes and pre-drafted next rounds:
    # specdec.engine.propose_tree.TreeRecord), valid until the slot is next written, i.e. the next append.
    draft_tree: object | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        self.draft_tree = None  # what it described past the old length is being overwritten
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def crop(self, length: int) -> None:
        """Forget tokens past `length`: a length change; the slot's stale entries get overwritten."""
        del self.tokens[length:]
        self.hashes.crop(length)


class SessionTable:
    """LRU map session_id -> Session over the slots of a SlotKVCache, bounded by slots, cached
    tokens and idle time; with the prefix cache, also the retained slots of ended sessions."""

    def __init__(self, config: SessionStoreConfig, cache: SlotKVCache, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self._clock = clock
        # Live sessions by id and retained ones by ("retained", n), together in LRU order.
        self._sessions: OrderedDict[Hashable, Session] = OrderedDict()
        self.index = PrefixIndex(config.prefix_block_tokens)
        self.evictions = 0  # live sessions evicted (retained slots dropped are not counted)
        self.cached_tokens = 0  # kept up to date by append / crop / free; retained slots included
        self.retained = 0  # retained slots now
        self.retained_tokens = 0  # tokens in them (part of cached_tokens)
        self.prefix_queries = 0  # tokens of fresh starts looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of them, tokens taken from it (vLLM's prefix_cache_hits)
        self._retained_keys: dict[Session, tuple[str, int]] = {}  # a retained session -> its key in _sessions
        self._next_retained = 0

    def __len__(self) -> int:
        """Live sessions."""
        return len(self._sessions) - self.retained

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def acquire(self, session_id: str, prefix_len: int, prefix_hash: int, tokens: Sequence[int] = (),
                reusable: int = 0) -> Session | None:
        """The session cropped to its first prefix_len tokens and marked busy, ready for new tokens.

        prefix_len == 0 starts the session afresh (creating it if needed); with the prefix cache on, it
        then holds the longest prefix of `tokens` (at most `reusable` of them) that a slot held, and
        session.reused says how many: the caller feeds only the rest. Otherwise the session must exist,
        hold at least prefix_len tokens and match prefix_hash, or PrefixMismatch is raised. Returns None
        when a new session needs a slot and every slot is busy (the caller waits).
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
            self.crop(session, prefix_len)
        else:
            session = self._start(session_id, session, tokens, reusable)
            if session is None:
                return None
        session.last_used = self._clock()
        session.busy = True
        self._sessions.move_to_end(session_id)
        return session

    def _start(self, session_id: str, session: Session | None, tokens: Sequence[int], reusable: int) -> Session | None:
        """A fresh start: the session (new or restarted) in a slot, holding the longest cached prefix."""
        if session is not None:
            self.crop(session, 0)
        donor, length = self._match(tokens, min(reusable, len(tokens)), exclude=session)
        # A retained donor is adopted when the request continues most of what it holds (the next turn of its
        # conversation); one that holds much more (a long conversation sharing only a system prompt) is copied
        # from, so that its conversation still finds it.
        adopt = donor is not None and donor.retained and 2 * length >= len(donor)
        if session is None:
            slot = None
            if not adopt:
                was_busy = donor is not None and donor.busy
                if donor is not None:
                    donor.busy = True  # not to be evicted for the slot it is about to fill
                slot = self._free_slot()
                if donor is not None:
                    donor.busy = was_busy
                if slot is None:
                    if donor is None or not donor.retained:
                        return None
                    adopt = True  # no other slot: the retained donor's own
            if adopt:  # the slot itself
                slot = donor.slot
                self._forget(donor)
                donor = None
            session = Session(session_id=session_id, slot=slot)
            self._sessions[session_id] = session
        elif adopt:  # trade slots, then drop the donor
            session.slot, donor.slot = donor.slot, session.slot
            self._free(self._key(donor))
            donor = None
        if donor is not None:
            self.cache.copy_prefix(donor.slot, session.slot, length)
        if self.config.prefix_cache:
            self.prefix_queries += len(tokens)
            self.prefix_hits += length
        self.append(session, list(tokens[:length]))
        session.reused = length
        return session

    def _match(self, tokens: Sequence[int], limit: int, exclude: Session | None) -> tuple[Session | None, int]:
        """The slot holding the longest prefix of tokens[:limit] (a retained one when several tie), and its length."""
        if not self.config.prefix_cache or limit < self.config.prefix_block_tokens:
            return None, 0
        hashes = PrefixHashes(tokens[:limit])
        for length, holders in self.index.candidates(hashes, limit):
            # Fingerprints are hints: the tokens decide. Retained slots first (adopted, not copied).
            valid = [s for s in holders if s is not exclude and s.tokens[:length] == list(tokens[:length])]
            if valid:
                donor = max(valid, key=lambda s: (self._extent(s, tokens, length, limit), s.retained))
                return donor, self._extent(donor, tokens, length, limit)
        return None, 0

    @staticmethod
    def _extent(holder: Session, tokens: Sequence[int], length: int, limit: int) -> int:
        """How far the holder's tokens match `tokens` past a matching prefix of `length`, up to limit."""
        end = min(len(holder), limit)
        while length < end and holder.tokens[length] == tokens[length]:
            length += 1
        return length

    def append(self, session: Session, tokens: list[int]) -> None:
        old = len(session)
        session.append(tokens)
        self.cached_tokens += len(tokens)
        if self.config.prefix_cache:
            self.index.extend(session, session.hashes, old)

    def crop(self, session: Session, length: int) -> None:
        if len(session) > length:
            self.cached_tokens -= len(session) - length
            session.crop(length)
            self.index.crop(session, length)

    def release(self, session: Session) -> None:
        """The session's work is done: free (or retain) it if it was ended meanwhile, then apply the token
        budget (never evicting a busy session)."""
        session.busy = False
        session.last_used = self._clock()
        if session.ended:
            self._end(session)
        else:
            self._apply_budget(keep=session)

    def _apply_budget(self, keep: Session | None = None) -> None:
        """Drop idle sessions and retained slots, least recently used first, until the tokens fit the budget
        (never a busy one, nor `keep`: a lone session over budget is kept)."""
        if self.cached_tokens <= self.config.max_cached_tokens:
            return
        for key, s in [(k, s) for k, s in self._sessions.items() if not s.busy and s is not keep]:
            if self.cached_tokens <= self.config.max_cached_tokens:
                break
            self._drop_idle(key, s)

    def remove(self, session_id: str) -> bool:
        """EndSession: free (or retain) now, or when its work in flight is done."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        if session.busy:
            session.ended = True
        else:
            self._end(session)
        return True

    def drop(self, session: Session) -> None:
        """Forget a session whose cache is unusable (a failed or half-fed step)."""
        if self._sessions.get(session.session_id) is session:
            self._free(session.session_id)

    def evict_idle(self) -> int:
        deadline = self._clock() - self.config.idle_ttl_s
        stale = [(k, s) for k, s in self._sessions.items() if s.last_used < deadline and not s.busy]
        for key, s in stale:
            self._drop_idle(key, s)
        return len(stale)

    def _end(self, session: Session) -> None:
        """An ended session: its slot stays as a retained prefix-cache entry if it holds a whole block."""
        key = self._key(session)
        if not self.config.prefix_cache or len(session) < self.config.prefix_block_tokens:
            self._free(key)
            return
        del self._sessions[key]
        self._next_retained += 1
        session.session_id, session.retained, session.ended = "", True, False
        key = ("retained", self._next_retained)
        self._sessions[key] = session  # the most recently used end
        self._retained_keys[session] = key
        self.retained += 1
        self.retained_tokens += len(session)
        self._apply_budget()

    def _drop_idle(self, key: Hashable, session: Session) -> None:
        self._free(key)
        if not session.retained:
            self.evictions += 1

    def _free_slot(self) -> int | None:
        slot = self.cache.allocate()
        if slot is None:
            idle = next(((k, s) for k, s in self._sessions.items() if not s.busy), None)  # least recently used
            if idle is None:
                return None
            self._drop_idle(*idle)
            slot = self.cache.allocate()
        return slot

    def _key(self, session: Session) -> Hashable:
        if not session.retained:
            return session.session_id
        return self._retained_keys[session]

    def _forget(self, session: Session) -> None:
        """Remove a session's entry, leaving its slot allocated (the caller takes it over)."""
        del self._sessions[self._key(session)]
        self.cached_tokens -= len(session)
        self.index.remove(session)
        if session.retained:
            del self._retained_keys[session]
            self.retained -= 1
            self.retained_tokens -= len(session)

    def _free(self, key: Hashable) -> None:
        session = self._sessions[key]
        self._forget(session)
        self.cache.release(session.slot)
