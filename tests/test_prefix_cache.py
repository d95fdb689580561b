"""The prefix cache inside a tier (specdec.engine.prefix_index, SessionTable's fresh starts, SlotKVCache.copy_prefix),
over a real (tiny) SlotKVCache and a fake clock:

- the index follows its holders exactly as they grow and shrink, and answers longest block first;
- an ended session's slot is retained (not a live session: its id is free, it is not counted), and the next
  fresh start whose tokens begin with its tokens adopts the slot itself; a live session's prefix is copied;
- the match is decided by the tokens (a fingerprint is only a hint), extends past the last block, leaves the
  tokens whose logits are wanted, and counts queries and hits;
- a copy donor is never evicted for the slot it fills; memory pressure drops retained slots first as LRU,
  and a fresh start then simply misses; with the cache off, nothing is retained.
"""

from __future__ import annotations

import torch

from specdec.core.prefix import PrefixHashes
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.prefix_index import PrefixIndex
from specdec.engine.sessions import Session, SessionStoreConfig, SessionTable

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"))
B = 4  # block tokens in these tests


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, **config) -> None:
        config.setdefault("prefix_block_tokens", B)
        self.clock = FakeClock()
        cfg = SessionStoreConfig(**config)
        self.cache = SlotKVCache(GEOMETRY, cfg.max_sessions, 64)
        self.store = SessionTable(cfg, self.cache, clock=self.clock)

    def write(self, session: Session, tokens: list[int]) -> None:
        """What a step does: write each token's KV (a value derived from the token and its position), append."""
        start = len(session)
        for layer in range(GEOMETRY.num_layers):
            for i, t in enumerate(tokens):
                self.cache.keys[layer][session.slot, :, start + i] = float(t * 1000 + start + i + layer)
                self.cache.values[layer][session.slot, :, start + i] = -float(t * 1000 + start + i + layer)
        self.cache.mark_written(session.slot, start + len(tokens))
        self.store.append(session, tokens)

    def run(self, session_id: str, tokens: list[int], num_logits: int = 1, end: bool = True) -> Session:
        """A fresh start over `tokens` as the engine does it: reuse what it can, feed the rest, release, end."""
        session = self.store.acquire(session_id, 0, 0, tokens, len(tokens) - num_logits)
        self.write(session, tokens[session.reused:])
        self.store.release(session)
        if end:
            self.store.remove(session_id)
        return session

    def assert_kv(self, session: Session, tokens: list[int]) -> None:
        """The slot holds exactly the KV a fresh prefill of `tokens` would have written."""
        for layer in range(GEOMETRY.num_layers):
            for i, t in enumerate(tokens):
                assert self.cache.keys[layer][session.slot, 0, i, 0] == t * 1000 + i + layer, (layer, i)
                assert self.cache.values[layer][session.slot, 1, i, 2] == -(t * 1000 + i + layer), (layer, i)


def seq(n: int, base: int = 1) -> list[int]:
    return [base + i for i in range(n)]


# --- the index -----------------------------------------------------------------------------------


def test_index_follows_holders_exactly_and_answers_longest_first():
    index = PrefixIndex(B)
    a, b = object(), object()
    tokens = seq(10)
    index.extend(a, PrefixHashes(tokens), 0)  # blocks at 4, 8
    index.extend(b, PrefixHashes(tokens[:5]), 0)  # block at 4
    assert len(index) == 3
    hits = list(index.candidates(PrefixHashes(tokens + [99]), 11))
    assert hits == [(8, [a]), (4, [a, b])]
    assert list(index.candidates(PrefixHashes(tokens), 7)) == [(4, [a, b])]  # never past the limit
    index.crop(a, 7)  # a rejected draft: the block at 8 goes
    assert list(index.candidates(PrefixHashes(tokens), 10)) == [(4, [a, b])]
    grown = PrefixHashes(tokens[:7] + [50, 51, 52, 53, 54])
    index.extend(a, grown, 7)  # a grows past 8 again with other tokens
    assert [n for n, _ in index.candidates(grown, 12)] == [12, 8, 4]
    assert list(index.candidates(PrefixHashes(tokens), 10)) == [(4, [a, b])]  # the old block at 8 is gone
    index.remove(a)
    index.remove(b)
    assert len(index) == 0 and list(index.candidates(PrefixHashes(tokens), 10)) == []


# --- fresh starts ----------------------------------------------------------------------------------


def test_an_ended_session_is_retained_and_its_next_turn_adopts_the_slot():
    h = Harness()
    turn1 = seq(10)
    first = h.run("conv-1", turn1)
    assert "conv-1" not in h.store and len(h.store) == 0  # ended: no live session, the id is free
    assert h.store.retained == 1 and h.store.retained_tokens == 10 and h.cache.free_slots == h.cache.num_slots - 1
    turn2 = turn1 + [77, 78, 79]
    second = h.run("conv-2", turn2, end=False)
    assert second.reused == 10 and second.slot == first.slot  # the slot itself, nothing copied
    assert second.tokens == turn2 and second.hashes.at(13) == PrefixHashes(turn2).at(13)
    assert h.store.retained == 0 and h.store.cached_tokens == 13
    assert h.store.prefix_queries == 10 + 13 and h.store.prefix_hits == 10
    h.assert_kv(second, turn2)


def test_a_live_sessions_prefix_is_copied_and_the_match_extends_past_the_last_block():
    h = Harness()
    system = seq(10)
    donor = h.run("a", system + [40, 41], end=False)  # live and idle
    other = h.run("b", system + [50, 51, 52], end=False)
    assert other.reused == 10 and other.slot != donor.slot  # blocks give 8; the tokens extend it to 10
    h.assert_kv(other, system + [50, 51, 52])
    h.assert_kv(donor, system + [40, 41])  # the donor is untouched
    assert "a" in h.store and "b" in h.store and h.store.retained == 0


def test_the_tokens_decide_not_the_fingerprints():
    h = Harness()
    liar = h.run("liar", seq(8, base=500), end=False)
    h.store.index.extend(liar, PrefixHashes(seq(8)), 0)  # the index claims it holds seq(8)
    honest = h.run("honest", seq(8) + [9], end=False)
    assert honest.reused == 0 and honest.slot != liar.slot
    h.assert_kv(honest, seq(8) + [9])


def test_the_tokens_whose_logits_are_wanted_are_always_fed():
    h = Harness()
    h.run("a", seq(12))
    same = h.run("b", seq(12), num_logits=1)  # the whole prompt cached: the last token is still fed
    assert same.reused == 11
    verify = h.run("c", seq(12), num_logits=5)  # a verify: 4 drafts and the last committed token
    assert verify.reused == 7
    short = h.run("d", seq(3), num_logits=1)  # shorter than a block: nothing looked up
    assert short.reused == 0


def test_a_restarted_session_trades_its_slot_for_a_retained_one():
    h = Harness()
    retained_slot = h.run("done", seq(9)).slot
    live = h.run("s", [5, 5, 5, 5, 5], end=False)
    live_slot = live.slot
    again = h.store.acquire("s", 0, 0, seq(9) + [1], 9)  # a full resend of session s
    assert again is live and again.reused == 9 and again.slot == retained_slot
    assert h.store.retained == 0 and h.cache.free_slots == h.cache.num_slots - 1
    assert live_slot in h.cache._free


def test_a_copy_donor_is_not_evicted_for_the_slot_it_fills():
    h = Harness(max_sessions=2)
    donor = h.run("a", seq(8), end=False)
    h.run("b", [3] * 8, end=False)
    h.clock.now += 1
    h.store.release(h.store.acquire("b", 8, PrefixHashes([3] * 8).at(8)))  # b more recent: a is the LRU
    c = h.run("c", seq(8) + [1], end=False)  # needs a slot: b goes, a is copied from
    assert c.reused == 8 and "a" in h.store and "b" not in h.store
    h.assert_kv(c, seq(8) + [1])
    assert donor.tokens == seq(8)


def test_memory_pressure_drops_retained_slots_lru_and_a_start_then_misses():
    h = Harness(max_sessions=3, max_cached_tokens=30)
    h.run("old", seq(12, base=100))
    h.clock.now += 1
    h.run("new", seq(12, base=200))
    assert h.store.retained == 2
    live = h.run("live", seq(12, base=300), end=False)  # 36 tokens > 30: the oldest retained slot goes
    assert h.store.retained == 1 and h.store.cached_tokens == 24 and h.store.evictions == 0
    miss = h.run("x", seq(12, base=100) + [1], end=False)  # its prefix was dropped: a miss, not an error
    assert miss.reused == 0 and miss.tokens == seq(12, base=100) + [1]
    h.assert_kv(miss, seq(12, base=100) + [1])
    # 37 tokens: the other retained slot goes too, before any live session
    assert h.store.retained == 0 and h.store.cached_tokens == 25 and h.store.evictions == 0
    assert live.tokens == seq(12, base=300) and "live" in h.store and "x" in h.store


def test_retained_slots_expire_with_the_idle_ttl():
    h = Harness(idle_ttl_s=10.0)
    h.run("a", seq(8))
    h.clock.now += 11
    assert h.store.evict_idle() == 1 and h.store.retained == 0 and h.store.cached_tokens == 0
    assert h.store.evictions == 0  # a retained slot is not a session


def test_with_the_cache_off_nothing_is_retained_or_reused():
    h = Harness(prefix_cache=False)
    h.run("a", seq(10))
    assert h.store.retained == 0 and h.cache.free_slots == h.cache.num_slots
    b = h.run("b", seq(10) + [1], end=False)
    assert b.reused == 0 and h.store.prefix_queries == 0 and h.store.prefix_hits == 0
    h.store.remove("b")
    assert len(h.store.index) == 0


def test_copy_prefix_copies_every_layer_and_marks_the_positions_written():
    cache = SlotKVCache(GEOMETRY, 3, 16)
    for layer in range(GEOMETRY.num_layers):
        cache.keys[layer][0] = torch.randn(2, 16, 3)
        cache.values[layer][0] = torch.randn(2, 16, 3)
    cache.mark_written(0, 10)
    cache.copy_prefix(0, 2, 7)
    for layer in range(GEOMETRY.num_layers):
        assert torch.equal(cache.keys[layer][2, :, :7], cache.keys[layer][0, :, :7])
        assert torch.equal(cache.values[layer][2, :, :7], cache.values[layer][0, :, :7])
    assert cache.initialized[2] == 7
    for bad in ((0, 0, 3), (0, 1, 11)):  # onto itself; past what the source holds
        try:
            cache.copy_prefix(*bad)
        except ValueError:
            continue
        raise AssertionError(f"copy_prefix{bad} did not refuse")


def test_a_busy_copy_donor_stays_busy():
    h = Harness(max_sessions=2)
    donor = h.store.acquire("a", 0, 0, seq(8), 7)
    h.write(donor, seq(8))  # a step done, its work still in flight: busy
    h.run("b", [3] * 8, end=False)
    c = h.run("c", seq(8) + [1], end=False)  # copies from a; b (idle) gives up its slot
    assert c.reused == 8 and donor.busy and "a" in h.store and "b" not in h.store
    h.store.release(donor)
    assert not donor.busy


def test_a_retained_slot_holding_much_more_is_copied_from_not_adopted():
    h = Harness()
    conversation = seq(8) + seq(20, base=300)  # a long conversation that began with a shared system prompt
    kept = h.run("conv", conversation)
    other = h.run("other", seq(8) + [1, 2], end=False)  # shares only the first 8 tokens
    assert other.reused == 8 and other.slot != kept.slot and h.store.retained == 1
    h.assert_kv(other, seq(8) + [1, 2])
    turn2 = h.run("conv-2", conversation + [5], end=False)  # the conversation still finds its whole slot
    assert turn2.reused == len(conversation) and turn2.slot == kept.slot


def test_when_no_other_slot_is_free_a_retained_donor_is_adopted_anyway():
    h = Harness(max_sessions=2)
    kept = h.run("conv", seq(8) + seq(20, base=300))
    busy = h.store.acquire("busy", 0, 0)
    other = h.run("other", seq(8) + [1, 2], end=False)
    assert other.reused == 8 and other.slot == kept.slot and h.store.retained == 0 and busy.busy
