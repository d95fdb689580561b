"""Exact cases for the suffix tree, its proposals, the shared cache of recent outputs and the
per-session proposer. Brute-force references recount every substring from the stored sequences."""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from array import array

import pytest

from coordinator.proposers.suffix import SuffixStrategy
from coordinator.proposers.suffix_cache import SuffixCache
from coordinator.proposers.suffix_tree import SuffixConfig, SuffixTree, speculate


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every string the tree holds (each position of each edge) with its count."""
    out = {}
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for t, child in (node.children or {}).items():
            p = path
            for tok in child.label:
                p = p + (tok,)
                out[p] = child.count
            stack.append((child, p))
    return out


def brute_counts(seqs, depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of at most depth tokens."""
    out: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        for s in range(len(seq)):
            for e in range(s + 1, min(len(seq), s + depth) + 1):
                out[tuple(seq[s:e])] = out.get(tuple(seq[s:e]), 0) + 1
    return out


def brute_speculate(seqs, context, max_tokens: int, cfg: SuffixConfig) -> tuple[list[int], list[float], int]:
    """Reference suffix decoding over sequences inserted one after another (no removals): for each
    match length m, follow the most frequent continuation among the occurrences (ties: the
    continuation that appeared first), within the depth bound; keep the best score, ties to the
    longer match."""
    depth = cfg.max_depth
    born = []  # (time each token was inserted)
    clock = 0
    for seq in seqs:
        born.append(list(range(clock, clock + len(seq))))
        clock += len(seq)
    best: tuple[list[int], list[float], int] = ([], [], 0)
    for m in range(1, min(len(context), depth - 1) + 1):
        pattern = list(context[-m:])
        occ = [(q, s) for q, seq in enumerate(seqs) for s in range(len(seq) - m + 1) if list(seq[s : s + m]) == pattern]
        if not occ:
            break
        if m < cfg.min_match:
            continue
        limit = min(max_tokens, int(m * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6))
        tokens, probs, p, length = [], [], 1.0, m
        while len(tokens) < limit and length < depth:
            nxt: dict[int, list] = {}
            for q, s in occ:
                if s + length < len(seqs[q]):
                    nxt.setdefault(seqs[q][s + length], []).append((q, s))
            if not nxt:
                break
            total = sum(len(v) for v in nxt.values())
            tok = min(nxt, key=lambda t: (-len(nxt[t]), min(born[q][s + length] for q, s in nxt[t])))
            if len(nxt[tok]) < total:
                p *= len(nxt[tok]) / total
            if p < cfg.min_token_prob:
                break
            tokens.append(tok)
            probs.append(p)
            occ = nxt[tok]
            length += 1
        if tokens and sum(probs) >= sum(best[1]) - 1e-12:
            best = (tokens, probs, m)
        if not any(s + m < len(seqs[q]) for q, s in [(q, s) for q, seq in enumerate(seqs)
                                                     for s in range(len(seq) - m + 1) if list(seq[s : s + m]) == pattern]):
            break  # no occurrence continues: longer matches cannot either
    return best


# --- insertion and counts ------------------------------------------------------------------------


def test_insert_small_example_exact():
    tree = SuffixTree(max_depth=3)
    tree.extend(0, [1, 2, 1, 2, 3])
    assert tree_counts(tree) == {
        (1,): 2, (2,): 2, (3,): 1,
        (1, 2): 2, (2, 1): 1, (2, 3): 1,
        (1, 2, 1): 1, (2, 1, 2): 1, (1, 2, 3): 1,
    }
    # root; [1 2] (count 2) with leaves [1] and [3]; [2] (count 2) with leaves [1 2] and [3]; leaf [3]
    assert tree.num_nodes == 8
    assert tree.root.children[1].label.tolist() == [1, 2] and tree.root.children[1].total == 2
    tree.check()


def test_counts_equal_brute_force_under_random_operations():
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        depth = rng.choice([2, 3, 5, 8, 24])
        tree = SuffixTree(depth)
        seqs: dict[int, list[int]] = {}
        closed: set[int] = set()
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.6:
                sid = rng.choice([s for s in seqs if s not in closed] or [0]) if rng.random() < 0.7 else rng.randint(0, 99)
                if sid in closed:
                    continue
                # (long appends of rarely repeated tokens: the unique suffixes' open leaves, synced as they are met)
                toks = [rng.randint(0, rng.choice([1, 3, 9, 100])) for _ in range(rng.randint(0, rng.choice([7, 40])))]
                tree.extend(sid, toks)
                seqs.setdefault(sid, []).extend(toks)
            elif seqs and r < 0.75:
                sid = rng.choice(list(seqs))
                tree.close(sid)
                closed.add(sid)
            elif seqs:
                sid = rng.choice(list(seqs))
                tree.remove(sid)
                del seqs[sid]
                closed.discard(sid)
            assert tree_counts(tree) == brute_counts(seqs.values(), depth)
            tree.check()
            checked += 1
    assert checked > 1000


def test_remove_everything_leaves_an_empty_tree():
    tree = SuffixTree(4)
    tree.extend(0, [5, 6, 5, 6, 7])
    tree.extend(1, [6, 5, 6, 8])
    tree.close(0)
    tree.remove(0)
    fresh = SuffixTree(4)
    fresh.extend(1, [6, 5, 6, 8])
    assert tree_counts(tree) == tree_counts(fresh) and tree.num_nodes == fresh.num_nodes
    tree.remove(1)
    assert tree.num_nodes == 1 and tree.num_label_tokens == 0 and tree.num_seq_tokens == 0
    assert tree.root.count == 0 and not tree.root.children


def test_extending_a_closed_sequence_is_refused():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2])
    tree.close(0)
    with pytest.raises(ValueError):
        tree.extend(0, [3])
    with pytest.raises(ValueError):
        SuffixTree(1)


# --- matching and proposals -----------------------------------------------------------------------


def test_locate_inside_an_edge_at_its_end_and_absent():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 4, 9, 1, 2, 5])
    node, j = tree.locate(array("i", [1, 2]))
    assert node.label.tolist() == [1, 2] and j == 2 and node.count == 2  # at a branching node's end
    node, j = tree.locate(array("i", [2, 3]))
    assert node.label.tolist() == [3, 4, 9, 1, 2, 5] and j == 1  # inside the edge under [2]
    assert tree.locate(array("i", [3, 5])) is None
    assert tree.locate(array("i", [7])) is None


def test_proposal_follows_the_most_frequent_continuation():
    cfg = SuffixConfig(max_depth=8, min_token_prob=0.0)
    tree = SuffixTree(cfg.max_depth)
    # after (1, 2): 3 three times, 4 once; after (1, 2, 3): always 7
    for i, cont in enumerate([3, 4, 3, 3]):
        tree.extend(i, [1, 2, cont, 7] if cont == 3 else [1, 2, cont, 8])
    d = speculate(tree, array("i", [9, 1, 2]), 8, cfg)
    assert d.match_len == 2 and d.tokens == [3, 7]
    assert d.probs == pytest.approx([0.75, 0.75]) and d.score == pytest.approx(1.5)
    # the match length caps the proposal: m * factor + offset
    d = speculate(tree, array("i", [9, 1, 2]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, max_spec_factor=0.5,
                                                              max_spec_offset=0.0))
    assert d.tokens == [3] and d.match_len == 2
    # the default limit is 2m + 2: a 1-token match proposes up to 4 tokens
    tree.extend(9, [5, 6, 7, 8, 9, 10])
    assert speculate(tree, array("i", [5]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0)).tokens == [6, 7, 8, 9]
    d = speculate(tree, array("i", [9, 1, 2]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, max_spec_factor=0.0,
                                                              max_spec_offset=1.0))
    assert d.tokens == [3]
    # min_match: a match shorter than that proposes nothing (the 1-token match above), a longer one as before
    assert speculate(tree, array("i", [5]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, min_match=2)).tokens == []
    assert speculate(tree, array("i", [4, 5]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, min_match=2)).tokens == []
    d = speculate(tree, array("i", [9, 1, 2]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, min_match=2))
    assert d.tokens == [3, 7] and d.match_len == 2
    assert speculate(tree, array("i", [9, 1, 2]), 8, SuffixConfig(max_depth=8, min_token_prob=0.0, min_match=3)).tokens == []
    with pytest.raises(ValueError, match="min_match"):
        SuffixConfig(min_match=0)
    # min_token_prob: a continuation less likely than that is not proposed
    assert speculate(tree, array("i", [9, 1, 2]), 8, SuffixConfig(max_depth=8, min_token_prob=0.8)).tokens == []
    # max_tokens
    assert speculate(tree, array("i", [9, 1, 2]), 1, cfg).tokens == [3]
    assert speculate(tree, array("i", [9, 1, 2]), 0, cfg).tokens == []


def test_longer_match_wins_ties_and_probability_decides_otherwise():
    cfg = SuffixConfig(max_depth=8, min_token_prob=0.0)
    tree = SuffixTree(8)
    tree.extend(0, [5, 1, 2, 3, 3])
    tree.extend(1, [6, 1, 2, 4, 4])
    # context (.., 5, 1, 2): the 3-token match (5, 1, 2) is certain of [3, 3]; (1, 2) is a coin flip
    d = speculate(tree, array("i", [5, 1, 2]), 2, cfg)
    assert (d.tokens, d.match_len, d.probs) == ([3, 3], 3, [1.0, 1.0])
    # context (.., 7, 1, 2): only the 2-token match, 3 and 4 tied at 0.5: the one seen first
    d = speculate(tree, array("i", [7, 1, 2]), 2, cfg)
    assert (d.tokens, d.match_len, d.probs) == ([3, 3], 2, [0.5, 0.5])


def test_depth_bounds_match_plus_proposal():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2, 3, 4, 5, 6])
    # a 3-token match leaves one token of depth, a 2-token match two: the shorter match wins
    d = speculate(tree, array("i", [1, 2, 3]), 8, SuffixConfig(max_depth=4, min_token_prob=0.0, max_spec_factor=1.0,
                                                               max_spec_offset=0.0))
    assert (d.tokens, d.match_len) == ([4, 5], 2)
    d = speculate(tree, array("i", [1, 2, 3]), 8, SuffixConfig(max_depth=4, min_token_prob=0.0, max_spec_factor=3.0,
                                                               max_spec_offset=0.0))
    assert (d.tokens, d.match_len) == ([4, 5, 6], 1)


def test_proposals_equal_brute_force():
    rng = random.Random(1)
    compared = 0
    for _ in range(200):
        cfg = SuffixConfig(max_depth=rng.choice([3, 5, 8]), max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                           max_spec_offset=rng.choice([0.0, 1.0]), min_token_prob=rng.choice([0.0, 0.1, 0.4]),
                           min_match=rng.choice([1, 1, 2, 3]))
        alphabet = rng.choice([2, 3, 5])
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 25))] for _ in range(rng.randint(1, 4))]
        tree = SuffixTree(cfg.max_depth)
        for i, seq in enumerate(seqs):
            tree.extend(i, seq)
            tree.close(i)
        for _ in range(5):
            context = [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
            k = rng.randint(1, 6)
            d = speculate(tree, array("i", context), k, cfg)
            tokens, probs, m = brute_speculate(seqs, context, k, cfg)
            assert (d.tokens, d.match_len) == (tokens, m if tokens else 0), (seqs, context, k, cfg)
            assert d.probs == pytest.approx(probs)
            compared += 1
    assert compared == 1000


def test_own_sequence_proposals_equal_walking_and_brute_force():
    """A session's tree proposes from where its own suffixes end (no walk); same result as walking
    the context from the root, and as the brute force over the sequence (whose own last occurrence
    has no continuation and so does not count)."""
    rng = random.Random(2)
    cfg = SuffixConfig(max_depth=6, min_token_prob=0.0)
    for _ in range(100):
        tree = SuffixTree(cfg.max_depth)
        seq: list[int] = []
        for _ in range(rng.randint(1, 8)):
            chunk = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
            tree.extend(0, chunk)
            seq += chunk
            own = speculate(tree, tree.seqs[0], 4, cfg, seq_id=0)
            walked = speculate(tree, array("i", seq), 4, cfg)
            tokens, probs, m = brute_speculate([seq], seq, 4, cfg)
            assert (own.tokens, own.probs, own.match_len) == (walked.tokens, walked.probs, walked.match_len)
            assert own.tokens == tokens and own.probs == pytest.approx(probs)


# --- the shared cache -------------------------------------------------------------------------------


def test_cache_evicts_oldest_beyond_max_entries():
    cache = SuffixCache(SuffixConfig(max_depth=8, min_token_prob=0.0, cache_entries=2))
    cache.add([10, 11, 12, 13])
    cache.add([20, 21, 22, 23])
    assert cache.speculate(array("i", [10, 11]), 2).tokens == [12, 13]
    cache.add([30, 31, 32, 33])
    assert cache.entries == 2
    assert cache.speculate(array("i", [10, 11]), 2).tokens == []  # the oldest is gone
    assert cache.speculate(array("i", [20, 21]), 2).tokens == [22, 23]
    assert cache.speculate(array("i", [30, 31]), 2).tokens == [32, 33]
    assert tree_counts(cache.tree) == brute_counts([[20, 21, 22, 23], [30, 31, 32, 33]], 8)


def test_cache_stays_within_its_memory_bound():
    rng = random.Random(3)
    outputs = [[rng.randrange(50_000) for _ in range(200)] for _ in range(20)]
    one = SuffixCache(SuffixConfig(cache_bytes=1 << 40))
    one.add(outputs[0])
    bound = int(3.5 * one.estimated_bytes)  # room for three outputs of this kind, not four
    cache = SuffixCache(SuffixConfig(cache_bytes=bound))
    for i, out in enumerate(outputs):
        cache.add(out)
        assert cache.estimated_bytes <= bound
        assert cache.entries == min(i + 1, 3)
    # the newest three are the ones kept
    assert tree_counts(cache.tree) == brute_counts(outputs[-3:], cache.config.max_depth)
    # an output bigger than the whole bound is not kept, and evicts nothing it did not need to
    small = SuffixCache(SuffixConfig(cache_bytes=one.estimated_bytes // 2))
    small.add(outputs[0])
    assert small.entries == 0 and small.tree.num_nodes == 1 and small.estimated_bytes <= one.estimated_bytes // 2


def test_cache_disabled_and_clear():
    off = SuffixCache(SuffixConfig(cache_entries=0))
    off.add([1, 2, 3])
    assert not off.enabled and off.entries == 0 and off.tree.num_nodes == 1
    cache = SuffixCache(SuffixConfig())
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    cache.clear()
    assert cache.entries == 0 and cache.tree.num_nodes == 1 and cache.estimated_bytes == SuffixTree.NODE_BYTES


def test_cache_async_add_equals_add_and_survives_concurrent_eviction():
    rng = random.Random(4)
    outputs = [[rng.randrange(7) for _ in range(rng.randint(1, 700))] for _ in range(4)]
    sync, chunked = SuffixCache(SuffixConfig()), SuffixCache(SuffixConfig())
    for out in outputs:
        sync.add(out)

    async def fill():
        await asyncio.gather(*(chunked.add_async(out) for out in outputs))  # interleaved chunks

    asyncio.run(fill())
    assert tree_counts(chunked.tree) == tree_counts(sync.tree) and chunked.entries == 4
    chunked.tree.check()
    # an output evicted while it is still being inserted stops cleanly
    small = SuffixCache(SuffixConfig(cache_entries=1))

    async def race():
        await asyncio.gather(small.add_async(outputs[0] * 3), small.add_async([1, 2, 3]))

    asyncio.run(race())
    assert small.entries == 1 and tree_counts(small.tree) == brute_counts([[1, 2, 3]], 24)
    small.tree.check()


@pytest.mark.slow
def test_memory_estimate_covers_measured_memory():
    rng = random.Random(5)
    datasets = [
        [[rng.randrange(50_000) for _ in range(300)] for _ in range(8)],  # little repetition
        [[rng.randrange(4) for _ in range(300)] for _ in range(8)],  # a lot of branching
        [list(range(100, 180)) * 3 for _ in range(4)],  # long repeats
    ]
    for outputs in datasets:
        tracemalloc.start(16)  # frames per allocation: enough to reach this test from the cache (64: 2x slower)
        cache = SuffixCache(SuffixConfig(cache_bytes=1 << 40))
        for out in outputs:
            cache.add(out)
        # only what this test's own calls allocated: other threads of the session (the test clusters'
        # event loops and engines) allocate meanwhile, and tracemalloc traces every thread
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, __file__, all_frames=True)])
        tracemalloc.stop()
        measured = sum(stat.size for stat in snapshot.statistics("filename"))
        assert measured <= cache.estimated_bytes <= 1.6 * measured, (measured, cache.estimated_bytes)


# --- the session's strategy --------------------------------------------------------------------------


def _proposer(cache, prompt):
    # ArcticInference's limit (a match of m tokens proposes at most m), which the cases below count with
    p = SuffixStrategy(SuffixConfig(max_depth=16, min_token_prob=0.0, max_spec_factor=1.0, max_spec_offset=0.0), cache, prompt)
    asyncio.run(p.start())
    return p


def test_session_proposes_from_its_own_prompt_and_output():
    p = _proposer(None, [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    prop = p.offer(3)
    assert prop.source == "suffix" and prop.tokens == [4, 5, 6] and prop.probs == [1.0, 1.0, 1.0] and prop.q == []
    p.commit([4, 5, 7])
    assert p.offer(4).tokens == []  # (.., 5, 7) never seen
    p.commit([1, 2])
    assert p.offer(4).tokens == [3, 4]  # (1, 2): 3 twice; then (1, 2, 3) -> 4 (a 2-token match proposes 2)


def test_shared_cache_serves_other_sessions():
    cfg = SuffixConfig(max_depth=16, min_token_prob=0.0)
    cache = SuffixCache(cfg)
    template = [50, 51, 52]  # e.g. the chat template's assistant header, the cached context
    cache.add(template + [60, 61, 62, 63, 64, 65])
    other = _proposer(cache, [7, 8, 9] + template)
    assert other.offer(3).tokens == [60, 61, 62]
    other.commit([60, 61])
    assert other.offer(8).tokens == [62, 63, 64, 65]
    # a session of another coordinator (another cache) does not see it
    assert _proposer(SuffixCache(cfg), [7, 8, 9] + template).offer(3).tokens == []
    # nor does a session when the shared tree is off
    assert _proposer(SuffixCache(SuffixConfig(cache_entries=0)), [7, 8, 9] + template).offer(3).tokens == []


def test_the_better_of_own_and_shared_tree_wins():
    cache = SuffixCache(SuffixConfig(max_depth=16, min_token_prob=0.0))
    for _ in range(3):
        cache.add([1, 2, 3, 40, 41])  # shared: (1, 2, 3) -> 40, 41 for sure
    p = _proposer(cache, [1, 2, 3, 30, 1, 2, 3, 31, 9, 1, 2, 3])  # own: (1, 2, 3) -> 30 or 31
    prop = p.offer(2)
    assert prop.tokens == [40, 41] and prop.probs == [1.0, 1.0]


def test_config_is_validated():
    for bad in (dict(max_depth=1), dict(min_token_prob=1.5), dict(max_spec_factor=-1.0), dict(cache_entries=-1),
                dict(cache_bytes=-1), dict(cache_context=-1)):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)
