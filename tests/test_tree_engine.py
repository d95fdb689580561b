"""Token trees through the model runner: one ragged step over token trees equals transformers' forward of
every root-to-node path, in every step mode, through both attention paths (the group of short feeds and
a long feed alone); after verification the accepted path's KV entries are moved into place
(SlotKVCache.move) and a continuation equals the full forward of the accepted sequence."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.engine.attention import tree_layout
from specdec.engine.runner import Feed
from specdec.models import load_model
from tests.helpers import device_model
from tests.step_modes import MODES, assert_close, make_runner

# (parents, committed tokens fed with the tree) per session of a step
TREES = [
    ([-1, -1, 0, 0, 1, 2, 2, 4], 1),  # a bushy tree after one committed token
    ([-1, 0, 1, 2], 3),  # a chain as a tree, after three committed tokens
    ([-1, -1, -1, 2, 3, 0], 2),
]


@pytest.fixture(scope="module", params=MODES)
def runner(tiny_target, request):
    return make_runner(tiny_target, request.param)


@pytest.fixture(scope="module")
def reference(tiny_target):
    return load_model(device_model(tiny_target))  # plain sdpa attention


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_layout_positions_and_hidden_pairs():
    positions, hidden = tree_layout(10, 6, [-1, -1, 0, 1])  # two committed tokens, then four nodes
    assert positions == [10, 11, 12, 12, 13, 13]
    # node 1 (index 3) must not see node 0 (index 2); node 2 (4) not node 1 (3); node 3 (5) not nodes 0, 2
    assert sorted(hidden) == [(3, 2), (4, 3), (5, 2), (5, 4)]
    assert tree_layout(4, 3, None) == ([4, 5, 6], [])


@pytest.mark.parametrize("prefix_lens,extra", [
    ([5, 9, 7], 0),  # every tree feed short: the group path (or a captured bucket)
    ([5, 9, 7], 40),  # the first session feeds 40 more committed tokens with its tree: it attends alone
])
def test_tree_step_equals_each_paths_forward(runner, reference, prefix_lens, extra):
    g = torch.Generator().manual_seed(sum(prefix_lens) + extra)
    slots = [runner.cache.allocate() for _ in TREES]
    try:
        prefixes = [torch.randint(3, 5000, (n,), generator=g).tolist() for n in prefix_lens]
        runner.forward([Feed(s, 0, p, 1) for s, p in zip(slots, prefixes)])
        feeds, cases = [], []
        for b, ((parents, m), slot, prefix) in enumerate(zip(TREES, slots, prefixes)):
            m += extra if b == 0 else 0
            committed = torch.randint(3, 5000, (m,), generator=g).tolist()
            nodes = torch.randint(3, 5000, (len(parents),), generator=g).tolist()
            nodes[1] = nodes[0]  # siblings or not, equal tokens must still be told apart by position in the tree
            feeds.append(Feed(slot, len(prefix), committed + nodes, len(parents) + 1, parents))
            cases.append((prefix + committed, nodes, parents))
        chain_slot = runner.cache.allocate()  # a chain shares the step
        chain = torch.randint(3, 5000, (6,), generator=g).tolist()
        feeds.append(Feed(chain_slot, 0, chain, 3))
        logits = runner.forward(feeds)
        for b, (committed, nodes, parents) in enumerate(cases):
            assert torch.isfinite(logits[b]).all()
            assert_close(logits[b][0], full_logits(reference, committed)[-1], (b, "root"))
            for i in range(len(parents)):
                seq = committed + [nodes[j] for j in path_to(parents, i)]
                assert_close(logits[b][1 + i], full_logits(reference, seq)[-1], (b, i))
        assert_close(logits[-1], full_logits(reference, chain)[-3:], "chain")
        runner.cache.release(chain_slot)
    finally:
        for s in slots:
            runner.cache.release(s)


@pytest.mark.parametrize("accepted_node", [7, 5, 3, 0])
def test_compaction_then_continuation_equals_the_accepted_sequence(runner, reference, accepted_node):
    """Accept the path to one node, move its KV entries into place, crop (the next feed starts right
    after it) and feed the next token plus a chain: logits equal the full forward."""
    parents = TREES[0][0]
    g = torch.Generator().manual_seed(accepted_node)
    slot = runner.cache.allocate()
    try:
        prefix = torch.randint(3, 5000, (8,), generator=g).tolist()
        nodes = torch.randint(3, 5000, (len(parents),), generator=g).tolist()
        runner.forward([Feed(slot, 0, prefix, 1)])
        runner.forward([Feed(slot, len(prefix), nodes, len(parents), parents)])
        path = path_to(parents, accepted_node)
        runner.cache.move(slot, [len(prefix) + j for j in path], list(range(len(prefix), len(prefix) + len(path))))
        accepted = prefix + [nodes[j] for j in path]
        more = torch.randint(3, 5000, (4,), generator=g).tolist()
        logits = runner.forward([Feed(slot, len(accepted), more, 4)])[0]
        assert_close(logits, full_logits(reference, accepted + more)[-4:], path)
    finally:
        runner.cache.release(slot)


# --- VerifyWork with a tree, through the engine -------------------------------------------------------


def test_engine_verifies_a_tree_greedily_then_continues_from_the_compacted_path(engine_parts, tiny_target_model):
    """A greedy tree whose second branch spells the target's greedy continuation: the engine accepts that
    path (nodes 1, 3, 4), moves its KV into place, and the next round (a chain after the committed path)
    continues exactly as the target's generate(). A chain and a sampled candidates tree share the step."""
    from tests.test_batching import fresh_engine, prompt, run_batch, verify_work
    from specdec.engine.verify import VerifyWork, CANDIDATES
    from specdec.math.params import SamplingParams
    from specdec.core.prefix import PrefixHashes
    from tests.helpers import reference_greedy

    ids = prompt(400, 12)
    g = reference_greedy(tiny_target_model, ids, 6, None)
    wrong = [(t + 17) % 40000 + 3 for t in g]
    parents = [-1, -1, 1, 1, 3, 3]
    tokens = [wrong[0], g[0], wrong[1], g[1], g[2], wrong[2]]
    engine = fresh_engine(engine_parts)
    engine.start()
    try:
        async def scenario():
            tree = VerifyWork.create("tree", 0, 0, ids, tokens, None, SamplingParams(), 1, parents=parents)
            chain = verify_work("chain", prompt(401, 7), [5, 6, 7], greedy=True)
            sampled = VerifyWork.create("cand", 0, 0, prompt(402, 9), tokens, None, SamplingParams(temperature=0.8), 3,
                                        parents=parents, scheme=CANDIDATES)
            first = await run_batch(engine, [tree, chain, sampled])
            committed = ids + g[:3]
            nxt = VerifyWork.create("tree", len(committed), PrefixHashes(committed).at(len(committed)), [g[3]], [g[4]],
                                    None, SamplingParams(), 2)
            return first, await engine.submit(nxt)

        (tree, chain, sampled), after = asyncio.run(scenario())
    finally:
        engine.close()
    assert (tree.path, tree.num_accepted, tree.next_token, tree.cached_len) == ((1, 3, 4), 3, g[3], len(ids) + 3)
    assert tree.batch_sessions == 3
    assert (after.num_accepted, after.next_token) == (1, g[5]), "the compacted cache continues the greedy output"
    assert chain.batch_sessions == sampled.batch_sessions == 3
    assert len(sampled.path) == sampled.num_accepted and sampled.cached_len == 9 + sampled.num_accepted
    assert all(parents[node] == (sampled.path[d - 1] if d else -1) for d, node in enumerate(sampled.path)), sampled.path


@pytest.fixture(scope="module")
def engine_parts(tiny_target):
    from specdec.models import load_tokenizer
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)
