"""Tests for specdec.core.prefix.PrefixHashes and specdec.engine.sessions.SessionTable.

The table runs here over a real (tiny) SlotKVCache and a fake clock.
"""

from __future__ import annotations

import random

import pytest

from specdec.core.prefix import PrefixHashes
import torch

from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.sessions import PrefixMismatch, Session, SessionStoreConfig, SessionTable

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



# --- SessionTable ---------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


class Harness:
    def __init__(self, **config) -> None:
        self.clock = FakeClock()
        cfg = SessionStoreConfig(**config)
        self.cache = SlotKVCache(GEOMETRY, cfg.max_sessions, 64)
        self.store = SessionTable(cfg, self.cache, clock=self.clock)

    def commit(self, session: Session, tokens: list[int]) -> None:
        """What the engine does after a step: append the fed tokens, then release the session."""
        self.store.append(session, tokens)
        self.store.release(session)

    def open(self, session_id: str, tokens: list[int]) -> Session:
        """Start a session afresh and commit `tokens`."""
        session = self.store.acquire(session_id, 0, 0)
        self.commit(session, tokens)
        return session


def fingerprint(tokens: list[int]) -> int:
    return PrefixHashes(tokens).at(len(tokens))


# --- acquire ----------------------------------------------------------------------------------------


def test_acquire_prefix_len_zero_creates_session_in_a_slot():
    h = Harness()
    session = h.store.acquire("a", 0, 0)
    assert "a" in h.store and len(h.store) == 1
    assert session.session_id == "a" and session.slot == 0
    assert session.tokens == [] and len(session) == 0
    assert session.busy and session.last_used == h.clock.now
    h.store.release(session)
    assert h.store.acquire("a", 0, 0) is session  # same session, same slot
    assert h.cache.free_slots == h.cache.num_slots - 1


def test_acquire_prefix_len_zero_restarts_existing_session():
    h = Harness()
    session = h.open("a", [1, 2, 3])
    again = h.store.acquire("a", 0, 0)
    assert again is session and again.tokens == [] and len(again.hashes) == 0
    assert h.store.cached_tokens == 0 and len(h.store) == 1


def test_acquire_matching_prefix_crops_speculative_tokens():
    h = Harness()
    session = h.open("a", [5, 6, 7, 8, 9])  # 8, 9 are speculative: the coordinator committed 3
    got = h.store.acquire("a", 3, fingerprint([5, 6, 7]))
    assert got is session and got.tokens == [5, 6, 7]
    assert len(got.hashes) == 3 and got.hashes.at(3) == fingerprint([5, 6, 7])
    assert h.store.cached_tokens == 3  # rollback is a length change
    h.commit(got, [11, 12])
    assert got.hashes.at(5) == fingerprint([5, 6, 7, 11, 12]) and h.store.cached_tokens == 5


def test_acquire_unknown_session_raises():
    h = Harness()
    with pytest.raises(PrefixMismatch):
        h.store.acquire("nope", 2, fingerprint([1, 2]))
    assert "nope" not in h.store and h.cache.free_slots == h.cache.num_slots


def test_acquire_too_short_raises_and_leaves_session_intact():
    h = Harness()
    h.open("a", [1, 2])
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 3, fingerprint([1, 2, 3]))
    assert h.store.acquire("a", 2, fingerprint([1, 2])).tokens == [1, 2]


@pytest.mark.parametrize("claimed", [[1, 2, 4], [9, 2, 3], [1, 2], [1, 2, 3, 4]])
def test_acquire_fingerprint_mismatch_raises_and_leaves_session_intact(claimed):
    h = Harness()
    session = h.open("a", [1, 2, 3, 4])
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 3, fingerprint(claimed))
    assert session.tokens == [1, 2, 3, 4] and not session.busy
    assert h.store.acquire("a", 3, fingerprint([1, 2, 3])).tokens == [1, 2, 3]


def test_crop_is_a_length_change():
    h = Harness()
    session = h.open("a", [1, 2, 3, 4])
    h.store.crop(session, 2)
    assert session.tokens == [1, 2] and session.hashes.at(2) == fingerprint([1, 2]) and len(session.hashes) == 2
    assert h.store.cached_tokens == 2 and session.slot == 0
    h.store.crop(session, 5)  # longer than the session: nothing to crop
    assert session.tokens == [1, 2] and h.store.cached_tokens == 2


# --- slots and eviction -----------------------------------------------------------------------------


def test_a_new_session_evicts_the_least_recently_used_idle_one_when_slots_run_out():
    h = Harness(max_sessions=2)
    h.open("a", [1])
    h.open("b", [2])
    h.store.release(h.store.acquire("a", 1, fingerprint([1])))  # a is now more recent than b
    c = h.open("c", [3])
    assert "b" not in h.store and "a" in h.store and "c" in h.store
    assert c.slot == 1 and h.store.evictions == 1  # b's slot, reused
    h.open("d", [4])
    assert [sid for sid in "abcd" if sid in h.store] == ["c", "d"] and h.store.evictions == 2


def test_busy_sessions_are_never_evicted_and_a_full_table_makes_new_sessions_wait():
    h = Harness(max_sessions=2)
    a = h.store.acquire("a", 0, 0)
    b = h.store.acquire("b", 0, 0)
    assert h.store.acquire("c", 0, 0) is None  # every slot busy: the caller waits
    assert "c" not in h.store and h.store.evictions == 0
    h.commit(a, [1])  # a is idle now
    c = h.store.acquire("c", 0, 0)
    assert c is not None and c.slot == a.slot and "a" not in h.store and b.busy


def test_token_budget_evicts_idle_sessions_oldest_first():
    h = Harness(max_cached_tokens=10)
    h.open("a", [1, 1, 1])
    h.open("b", [2, 2, 2])
    h.open("c", [3, 3, 3])
    assert h.store.cached_tokens == 9 and h.store.evictions == 0
    h.open("d", [4] * 7)  # 16 tokens: evict a (13), then b (10)
    assert "a" not in h.store and "b" not in h.store and "c" in h.store and "d" in h.store
    assert h.store.cached_tokens == 10 and h.store.evictions == 2


def test_token_budget_never_evicts_the_released_session_or_a_busy_one():
    h = Harness(max_cached_tokens=10)
    a = h.store.acquire("a", 0, 0)
    busy = h.store.acquire("z", 0, 0)
    h.store.append(busy, [9] * 3)
    h.open("b", [2] * 4)
    h.commit(a, [1] * 8)  # 15 tokens: b goes; z is busy, a is the one released
    assert "a" in h.store and "z" in h.store and "b" not in h.store
    assert h.store.evictions == 1


def test_a_lone_session_over_budget_is_kept():
    h = Harness(max_cached_tokens=4, max_sessions=1)
    h.open("a", [1] * 2)
    session = h.open("b", [1] * 9)
    assert "a" not in h.store and "b" in h.store and session.tokens == [1] * 9


def test_idle_ttl_eviction_spares_busy_sessions():
    h = Harness(idle_ttl_s=10.0)
    h.open("a", [1])
    busy = h.store.acquire("z", 0, 0)
    h.clock.now += 6
    h.open("b", [2])
    h.clock.now += 5  # a idle for 11 s, b for 5 s; z busy for 11 s
    assert h.store.evict_idle() == 1
    assert "a" not in h.store and "b" in h.store and "z" in h.store and busy.busy
    assert h.store.evict_idle() == 0


def test_acquire_of_an_idle_expired_session_raises():
    h = Harness(idle_ttl_s=10.0)
    h.open("a", [1, 2])
    h.clock.now += 11
    with pytest.raises(PrefixMismatch):
        h.store.acquire("a", 2, fingerprint([1, 2]))
    assert "a" not in h.store and h.store.evictions == 1
    assert h.store.acquire("a", 0, 0).tokens == []


def test_remove_frees_the_slot_or_defers_while_busy():
    h = Harness(max_sessions=2)
    h.open("a", [1, 2])
    b = h.store.acquire("b", 0, 0)
    h.store.append(b, [3])
    assert h.store.remove("a") is True and "a" not in h.store and h.cache.free_slots == 1
    assert h.store.remove("a") is False and h.store.remove("zzz") is False
    assert h.store.remove("b") is True and "b" in h.store  # busy: freed when its work is done
    h.store.release(b)
    assert "b" not in h.store and h.cache.free_slots == 2 and h.store.cached_tokens == 0
    assert h.store.evictions == 0  # removal is not eviction


def test_drop_forgets_a_session_with_an_unusable_cache():
    h = Harness()
    a = h.store.acquire("a", 0, 0)
    h.store.append(a, [1, 2])
    h.store.drop(a)
    assert "a" not in h.store and h.store.cached_tokens == 0 and h.cache.free_slots == h.cache.num_slots


def test_a_hypothetical_continuation_equals_the_copied_sequence_and_its_fingerprints():
    """The overlap's speculative request reads committed + drafts through views (no O(context) copy)."""
    from coordinator.tiers.cursor import Extended, TierCursor

    committed, drafts = list(range(100, 140)), [7, 8, 9]
    hashes = PrefixHashes(committed)
    seq, ext = Extended(committed, drafts), hashes.extended(drafts)
    full = committed + drafts
    assert len(seq) == len(ext) == len(full) and list(seq) == full
    assert [seq[i] for i in range(-3, len(full))] == full[-3:] + full
    for a in (0, 5, 39, 40, 41, 43):
        for b in (a, 41, 43, None):
            assert seq[a:b] == full[a:b]
    assert [ext.at(n) for n in range(len(full) + 1)] == [PrefixHashes(full).at(n) for n in range(len(full) + 1)]
    cursor = TierCursor()
    cursor.base, cursor.tail = 38, [138, 139, 7]
    assert cursor.context("s", seq, ext) == cursor.context("s", full, PrefixHashes(full))
