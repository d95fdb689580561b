"""Tests for specdec.wire.prefix.PrefixHashes and specdec.engine.sessions.SessionStore.

SessionStore runs here with a fake KV cache (records its crops) and a fake clock.
"""

from __future__ import annotations

import random

import pytest

from specdec.wire.prefix import PrefixHashes
from specdec.engine.sessions import PrefixMismatch, Session, SessionStore, SessionStoreConfig

# --- PrefixHashes ------------------------------------------------------------------------------


def test_prefix_hashes_empty_prefix_is_zero():
    assert PrefixHashes().at(0) == 0
    assert len(PrefixHashes()) == 0
    h = PrefixHashes([7, 8, 9])
    assert h.at(0) == 0
    assert len(h) == 3
    assert all(h.at(n) != 0 for n in range(1, 4))  # a non-empty prefix never looks empty


def test_prefix_hashes_equal_sequences_equal_hashes():
    tokens = [random.Random(0).randrange(50_000) for _ in range(64)]
    a, b = PrefixHashes(tokens), PrefixHashes(list(tokens))
    assert [a.at(n) for n in range(65)] == [b.at(n) for n in range(65)]
    # Building in chunks gives the same fingerprints as building in one go.
    c = PrefixHashes()
    for i in range(0, 64, 5):
        c.extend(tokens[i : i + 5])
    assert [c.at(n) for n in range(65)] == [a.at(n) for n in range(65)]


def test_prefix_hashes_differ_on_any_changed_token():
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(40)]
    base = PrefixHashes(tokens)
    for i in range(len(tokens)):
        for new in (tokens[i] + 1, tokens[i] - 1, 0, 999_999):
            if new == tokens[i]:
                continue
            changed = tokens[:i] + [new] + tokens[i + 1 :]
            h = PrefixHashes(changed)
            assert all(h.at(n) == base.at(n) for n in range(i + 1))  # prefixes before i agree
            assert all(h.at(n) != base.at(n) for n in range(i + 1, len(tokens) + 1))  # the rest differ


def test_prefix_hashes_order_and_length_sensitive():
    assert PrefixHashes([1, 2]).at(2) != PrefixHashes([2, 1]).at(2)
    assert PrefixHashes([0]).at(1) != PrefixHashes([0, 0]).at(2)
    assert PrefixHashes([5]).at(1) != PrefixHashes([5, 5]).at(2)
    # No two single-token or two-token prefixes over a small vocab collide.
    fingerprints = {PrefixHashes([a]).at(1) for a in range(100)}
    fingerprints |= {PrefixHashes([a, b]).at(2) for a in range(100) for b in range(100)}
    assert len(fingerprints) == 100 + 100 * 100


def test_prefix_hashes_crop_then_extend_equals_fresh_build():
    h = PrefixHashes([1, 2, 3, 4, 5, 6])
    h.crop(3)
    assert len(h) == 3
    assert h.at(3) == PrefixHashes([1, 2, 3]).at(3)
    h.extend([9, 9])
    fresh = PrefixHashes([1, 2, 3, 9, 9])
    assert len(h) == 5
    assert [h.at(n) for n in range(6)] == [fresh.at(n) for n in range(6)]
    h.crop(0)
    assert len(h) == 0 and h.at(0) == 0
    h.extend([4])
    assert h.at(1) == PrefixHashes([4]).at(1)
    h.crop(10)  # cropping past the end is a no-op
    assert len(h) == 1


# --- SessionStore fixtures ----------------------------------------------------------------------


class FakeCache:
    """Stands in for a model's KV cache: a length, and the lengths it was cropped to."""

    def __init__(self) -> None:
        self.length = 0
        self.crops: list[int] = []

    def get_seq_length(self) -> int:
        return self.length


def crop_cache(cache: FakeCache, length: int) -> None:
    cache.crops.append(length)
    cache.length = length


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, **config) -> None:
        self.clock = FakeClock()
        self.caches: list[FakeCache] = []
        self.store = SessionStore(SessionStoreConfig(**config), self._new_cache, crop_cache, clock=self.clock)

    def _new_cache(self) -> FakeCache:
        cache = FakeCache()
        self.caches.append(cache)
        return cache

    def commit(self, session: Session, tokens: list[int]) -> None:
        """What a tier does after a forward pass: append tokens to the cache and the session."""
        session.cache.length += len(tokens)
        session.append(tokens)
        self.store.release(session)

    def open(self, session_id: str, tokens: list[int]) -> Session:
        """Start a session afresh and commit `tokens`."""
        session = self.store.acquire(session_id, 0, 0)
        self.commit(session, tokens)
        return session


def fingerprint(tokens: list[int]) -> int:
    return PrefixHashes(tokens).at(len(tokens))


# --- SessionStore: acquire ------------------------------------------------------------------------


def test_acquire_prefix_len_zero_creates_session():
    h = Harness()
    session = h.store.acquire("a", 0, 0)
    assert "a" in h.store and len(h.store) == 1
    assert session.session_id == "a"
    assert session.tokens == [] and len(session) == 0
    assert session.cache is h.caches[0]
    assert session.last_used == h.clock.now
    assert h.store.acquire("a", 0, 0) is session  # same session, no second cache
    assert len(h.caches) == 1


def test_acquire_prefix_len_zero_restarts_existing_session():
    h = Harness()
    session = h.open("a", [1, 2, 3])
    again = h.store.acquire("a", 0, 0)
    assert again is session and again.session_id == "a"  # the same entry, cropped to nothing
    assert again.tokens == [] and len(again.hashes) == 0
    assert again.cache.get_seq_length() == 0
    assert h.caches[0].crops == [0]
    assert len(h.store) == 1


def test_acquire_matching_prefix_crops_speculative_tokens():
    h = Harness()
    session = h.open("a", [5, 6, 7, 8, 9])  # 8, 9 are speculative: the coordinator committed 3
    got = h.store.acquire("a", 3, fingerprint([5, 6, 7]))
    assert got is session
    assert got.tokens == [5, 6, 7]
    assert len(got.hashes) == 3 and got.hashes.at(3) == fingerprint([5, 6, 7])
    assert got.cache.crops == [3] and got.cache.get_seq_length() == 3
    # Appending after the crop fingerprints the new sequence.
    h.commit(got, [11, 12])
    assert got.hashes.at(5) == fingerprint([5, 6, 7, 11, 12])


def test_acquire_exact_length_does_not_crop():
    h = Harness()
    h.open("a", [5, 6, 7])
    got = h.store.acquire("a", 3, fingerprint([5, 6, 7]))
    assert got.tokens == [5, 6, 7]
    assert got.cache.crops == []


def test_acquire_unknown_session_raises():
    h = Harness()
    with pytest.raises(PrefixMismatch):
        h.store.acquire("nope", 2, fingerprint([1, 2]))
    assert "nope" not in h.store and len(h.caches) == 0


def test_acquire_too_short_raises_and_leaves_session_intact():
    h = Harness()
    h.open("a", [1, 2])
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 3, fingerprint([1, 2, 3]))
    assert h.store.acquire("a", 2, fingerprint([1, 2])).tokens == [1, 2]


@pytest.mark.parametrize(
    "claimed",
    [
        [1, 2, 4],  # last token differs
        [9, 2, 3],  # first token differs
        [1, 2],  # the hash of a different length
        [1, 2, 3, 4],
    ],
)
def test_acquire_fingerprint_mismatch_raises_and_leaves_session_intact(claimed):
    h = Harness()
    session = h.open("a", [1, 2, 3, 4])
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 3, fingerprint(claimed))
    assert session.tokens == [1, 2, 3, 4] and session.cache.crops == []
    assert h.store.acquire("a", 3, fingerprint([1, 2, 3])).tokens == [1, 2, 3]


def test_store_crop():
    h = Harness()
    session = h.open("a", [1, 2, 3, 4])
    h.store.crop(session, 2)
    assert session.tokens == [1, 2] and session.hashes.at(2) == fingerprint([1, 2]) and len(session.hashes) == 2
    assert session.cache.crops == [2]
    h.store.crop(session, 5)  # longer than the session: nothing to crop
    assert session.tokens == [1, 2] and session.cache.crops == [2]


# --- SessionStore: eviction -----------------------------------------------------------------------


def test_lru_eviction_by_max_sessions():
    h = Harness(max_sessions=2)
    h.open("a", [1])
    h.open("b", [2])
    assert h.store.evictions == 0
    h.store.acquire("a", 1, fingerprint([1]))  # a is now more recent than b
    h.open("c", [3])
    assert "b" not in h.store
    assert "a" in h.store and "c" in h.store
    assert len(h.store) == 2 and h.store.evictions == 1
    h.open("d", [4])
    assert [sid for sid in "abcd" if sid in h.store] == ["c", "d"]
    assert "a" not in h.store and h.store.evictions == 2


def test_lru_eviction_by_max_cached_tokens():
    h = Harness(max_cached_tokens=10)
    h.open("a", [1, 1, 1])
    h.open("b", [2, 2, 2])
    h.open("c", [3, 3, 3])
    assert h.store.cached_tokens == 9 and h.store.evictions == 0
    h.open("d", [4] * 7)  # 16 tokens: evict a (13), then b (10)
    assert "a" not in h.store and "b" not in h.store
    assert "c" in h.store and "d" in h.store
    assert h.store.cached_tokens == 10 and h.store.evictions == 2


def test_eviction_never_evicts_the_released_session():
    h = Harness(max_cached_tokens=10)
    a = h.store.acquire("a", 0, 0)
    h.open("b", [2] * 4)  # b is now more recent than a
    h.commit(a, [1] * 8)  # 12 tokens; a is the least recently used, but it is the one released
    assert "a" in h.store and "b" not in h.store
    assert h.store.evictions == 1


def test_eviction_by_max_sessions_never_evicts_the_released_session():
    h = Harness(max_sessions=2)
    a = h.store.acquire("a", 0, 0)
    h.store.acquire("b", 0, 0)
    h.store.acquire("c", 0, 0)  # three sessions; a is the least recently used
    h.commit(a, [1])
    assert [sid for sid in "abc" if sid in h.store] == ["a", "c"]
    assert h.store.evictions == 1


def test_eviction_keeps_a_lone_session_over_budget():
    h = Harness(max_cached_tokens=4, max_sessions=1)
    h.open("a", [1] * 2)
    session = h.open("b", [1] * 9)  # alone and over budget: kept
    assert "a" not in h.store
    assert "b" in h.store and session.tokens == [1] * 9
    assert h.store.evictions == 1


def test_release_under_capacity_evicts_nothing():
    h = Harness(max_sessions=3, max_cached_tokens=9)
    for sid in "abc":
        h.open(sid, [0, 0, 0])
    assert len(h.store) == 3 and h.store.evictions == 0


def test_idle_ttl_eviction():
    h = Harness(idle_ttl_s=10.0)
    h.open("a", [1])
    h.clock.now += 6
    h.open("b", [2])
    h.clock.now += 5  # a idle for 11 s, b for 5 s
    assert h.store.evict_idle() == 1
    assert "a" not in h.store and "b" in h.store
    assert h.store.evictions == 1
    assert h.store.evict_idle() == 0


def test_acquire_refreshes_idle_timer():
    h = Harness(idle_ttl_s=10.0)
    h.open("a", [1, 2])
    h.clock.now += 8
    h.store.acquire("a", 2, fingerprint([1, 2]))
    h.clock.now += 8  # 16 s after creation, 8 s after last use
    assert h.store.evict_idle() == 0
    assert h.store.acquire("a", 2, fingerprint([1, 2])).tokens == [1, 2]


def test_acquire_of_an_idle_expired_session_raises():
    h = Harness(idle_ttl_s=10.0)
    h.open("a", [1, 2])
    h.clock.now += 11
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 2, fingerprint([1, 2]))
    assert "a" not in h.store and h.store.evictions == 1
    # prefix_len 0 starts it afresh with a new cache.
    session = h.store.acquire("a", 0, 0)
    assert session.tokens == [] and len(h.caches) == 2


def test_remove():
    h = Harness()
    h.open("a", [1, 2])
    h.open("b", [3])
    assert h.store.remove("a") is True
    assert "a" not in h.store and len(h.store) == 1
    assert h.store.remove("a") is False
    assert h.store.remove("zzz") is False
    assert h.store.evictions == 0  # removal is not eviction
    assert h.store.cached_tokens == 1
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 2, fingerprint([1, 2]))


def test_evictions_counter_counts_all_kinds():
    h = Harness(max_sessions=2, idle_ttl_s=100.0)
    h.open("a", [1])
    h.open("b", [1])
    h.open("c", [1])  # LRU: a
    assert h.store.evictions == 1
    h.clock.now += 101
    h.open("d", [1])  # idle: b and c, on acquire
    assert h.store.evictions == 3
    assert [sid for sid in "abcd" if sid in h.store] == ["d"]
    h.store.remove("d")
    assert h.store.evictions == 3
