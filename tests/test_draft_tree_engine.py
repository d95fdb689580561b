"""The draft's token trees in its engine (specdec.engine.propose_tree): a tree grown over several feeds
attends exactly as transformers' forward of each path; trees have the requested shape and draw as the
chain where they coincide; after the target's verdict the draft keeps only the accepted path's entries
and continues as the full forward of the accepted sequence; the speculation cache answers the next round
with what a fresh proposal returns."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.core.prefix import PrefixHashes
from specdec.engine.config import BatchConfig, ModelConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.engine.propose import ProposeWork
from specdec.engine.propose_tree import ProposeTreeWork
from specdec.engine.tree_growth import GREEDY, TreeShape
from specdec.engine.runner import Feed
from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT
from specdec.math.params import SamplingParams
from specdec.models import TokenizerSource, load_model, load_tokenizer
from tests.helpers import device_model, reference_greedy
from tests.step_modes import assert_close, make_runner
from tests.test_tree_engine import full_logits, path_to

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def prompt(i: int, n: int) -> list[int]:
    return [1] + [(1000 + 7919 * i + 104729 * j) % 40000 + 3 for j in range(n - 1)]


@pytest.mark.parametrize("mode", ["eager", "packed", "static"])
def test_a_tree_grown_level_by_level_attends_as_each_paths_forward(tiny_target, tiny_target_model, mode):
    """Levels fed one step each (the earlier levels cached, some hidden from the new nodes), beside a
    chain session: every node's logits equal the full forward of its root-to-node path."""
    runner = make_runner(tiny_target, mode)
    parents = [-1, -1, 0, 0, 1, 2, 3, 3]  # levels: [0, 1], [2, 3, 4], [5, 6, 7]
    levels = [[0, 1], [2, 3, 4], [5, 6, 7]]
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 5000, (9,), generator=g).tolist()
    nodes = torch.randint(3, 5000, (len(parents),), generator=g).tolist()
    slot, other = runner.cache.allocate(), runner.cache.allocate()
    try:
        runner.forward([Feed(slot, 0, prefix, 1), Feed(other, 0, prefix[:4], 1)])
        fed = 0
        for k, level in enumerate(levels):
            new = [nodes[i] for i in level]
            logits = runner.forward([Feed(slot, len(prefix) + fed, new, len(new), parents[: fed + len(new)]),
                                     Feed(other, 4 + k, [prefix[4 + k]], 1)])[0]
            for row, i in enumerate(level):
                seq = prefix + [nodes[j] for j in path_to(parents, i)]
                assert_close(logits[row], full_logits(tiny_target_model, seq)[-1], (mode, i))
            fed += len(new)
    finally:
        runner.cache.release(slot)
        runner.cache.release(other)


@pytest.fixture(scope="module")
def parts(tiny_target):
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)


@pytest.fixture()
def engine(parts):
    model, tokenizer = parts
    e = Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig()), model, TokenizerSource.of(tokenizer))
    e.start()
    yield e
    e.close()


def tree_work(sid, committed, prefix_len, shape, params=SamplingParams(), seed=7, speculate=0):
    h = PrefixHashes(committed).at(prefix_len)
    return ProposeTreeWork.create(sid, prefix_len, h, committed[prefix_len:], shape, params, seed, 64, speculate)


def run(engine, works):
    async def go():
        with engine.paused():
            tasks = [asyncio.ensure_future(engine.submit(w)) for w in works]
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)
    return asyncio.run(go())


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


@pytest.mark.parametrize("shape", [TreeShape(8, 3, 2, GREEDY), TreeShape(6, 6, 3, GREEDY), TreeShape(4, 1, 4, GREEDY),
                                   TreeShape(16, 4, 2, WITHOUT_REPLACEMENT), TreeShape(7, 3, 2, IID),
                                   TreeShape(5, 2, 3, CANDIDATES)])
def test_tree_shapes_and_the_greedy_spine(engine, tiny_target_model, shape):
    """Within budget and depth, parents before children; b children per expanded node. Greedy: each
    level's first child is the argmax, so the first-child spine is the model's greedy continuation; WOR
    and candidate siblings are distinct; sampled trees carry one q row per node."""
    params = SamplingParams() if shape.scheme == GREEDY else SAMPLED
    ids = prompt(1, 10)
    (r,) = run(engine, [tree_work("s", ids, 0, shape, params)])
    n = len(r.tokens)
    assert 1 <= n <= shape.nodes and r.cached_len == len(ids)
    parents = r.parents if shape.branching > 1 else list(range(-1, n - 1))
    assert len(parents) == n and all(p < i for i, p in enumerate(parents))
    assert max(depths(parents)) < shape.depth
    kids = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    assert all(len(c) <= shape.branching for c in kids.values())
    assert len(kids[-1]) == min(shape.branching, shape.nodes)
    if shape.scheme in (GREEDY, WITHOUT_REPLACEMENT, CANDIDATES):
        assert all(len({r.tokens[i] for i in c}) == len(c) for c in kids.values())
    if shape.scheme in (IID, WITHOUT_REPLACEMENT):
        assert r.q is not None and r.q.num_rows == n
    else:
        assert r.q is None
    if shape.scheme == GREEDY:
        spine, node = [], -1
        while node in kids:
            node = kids[node][0]
            spine.append(r.tokens[node])
        assert spine == reference_greedy(tiny_target_model, ids, len(spine), None)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED])
def test_a_branching_one_tree_is_the_chain(engine, params):
    """b = 1 draws exactly what ProposeWork's chain draws (same keys), greedy and sampled, batched together."""
    ids = prompt(2, 12)
    shape = TreeShape(5, 5, 1, GREEDY if params.greedy else IID)
    chain = ProposeWork.create("c", 0, 0, ids, 5, params, 11, 64)
    tree, ref = run(engine, [tree_work("t", ids, 0, shape, params, seed=11), chain])
    assert tree.parents == [] and tree.tokens == ref.tokens
    if not params.greedy:
        for i in range(5):
            assert torch.equal(tree.q.row(i)[0], ref.q.row(i)[0])


def test_compaction_continues_as_the_accepted_sequence(engine, tiny_target_model):
    """After a greedy tree, the next request's tokens (a path of the tree + one more) are moved into place,
    not fed (salvaged), and the proposal that follows is the greedy continuation of the accepted sequence,
    the full forward's."""
    ids = prompt(3, 9)
    shape = TreeShape(8, 3, 2, GREEDY)
    (r,) = run(engine, [tree_work("s", ids, 0, shape)])
    fed = set(r.parents) - {-1}  # nodes with children were fed (their KV is held); leaves were not
    node = max(i for i in fed if r.parents[i] >= 0)  # a fed depth-1 node, off the spine where there is one
    path = path_to(r.parents, node)
    committed = ids + [r.tokens[i] for i in path] + [17]
    (nxt,) = run(engine, [tree_work("s", committed, len(ids), TreeShape(4, 4, 1, GREEDY))])
    assert nxt.salvaged == len(path)
    assert nxt.tokens == reference_greedy(tiny_target_model, committed, 4, None)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED])
def test_the_speculation_cache_answers_as_a_fresh_proposal(parts, params):
    """Pre-drafted next rounds: a next request ending at a cached outcome is answered from the cache
    (speculated) with the proposal a fresh engine returns for the same committed tokens; one ending
    elsewhere is drafted as usual. Both engines give the same proposals either way."""
    model, tokenizer = parts
    shape = TreeShape(6, 3, 2, GREEDY if params.greedy else WITHOUT_REPLACEMENT)
    ids = prompt(4, 11)
    hits = 0
    for probe in range(3):
        cached = Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig()), model, TokenizerSource.of(tokenizer))
        fresh = Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig()), model, TokenizerSource.of(tokenizer))
        cached.start(), fresh.start()
        try:
            (r,) = run(cached, [tree_work("s", ids, 0, shape, params, speculate=4)])
            record = None
            for _ in range(200):  # the speculation runs on after the answer
                session = cached.sessions.get("s")
                record = session.draft_tree if session is not None and not session.busy else None
                if record is not None:
                    break
                asyncio.run(asyncio.sleep(0.01))
            assert record is not None and record.prepared
            outcomes = sorted(record.prepared)
            target = outcomes[min(probe, len(outcomes) - 1)] if probe < 2 else None
            if target is None:  # an outcome not cached: the root's child with an unlikely token
                path_tokens = [r.tokens[0], 5]
            else:
                path, node = [], target
                while node >= 0:
                    path.append(record.tokens[node])
                    node = record.parents[node]
                path_tokens = path[::-1]
            committed = ids + path_tokens
            (got,) = run(cached, [tree_work("s", committed, len(ids), shape, params, speculate=4)])
            (want,) = run(fresh, [tree_work("s", committed, 0, shape, params)])
            assert got.speculated == (target is not None)
            hits += got.speculated
            assert (got.tokens, got.parents) == (want.tokens, want.parents)
            if want.q is not None:
                for i in range(want.q.num_rows):
                    assert torch.equal(got.q.row(i)[0], want.q.row(i)[0])
                    assert torch.allclose(got.q.row(i)[1], want.q.row(i)[1], atol=1e-5)
        finally:
            cached.close(), fresh.close()
    assert hits == 2
