"""Token trees through the real servers: with the coordinator's tree_nodes on, prompt lookup and suffix
decoding propose token trees (their several matches as branches), the target verifies each in one
forward, and the greedy output equals the target's own generate(); seeded sampling through trees is
reproducible and never equals a different seed's run by accident of a stuck sampler. The target really
received branching trees and accepted some of their nodes (counted from its servicer)."""

from __future__ import annotations

import pytest

from specdec.client import Client
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

REPETITIVE = [1, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282, 611, 314, 30, 504, 3937, 282, 4193, 314, 30, 504,
              3937, 282, 611, 314, 30, 504, 3937]
PROMPTS = [REPETITIVE, [1, 9038, 2115, 253, 1345, 9038, 2115, 253, 700, 9038, 2115]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def tree_cluster(tiny_target):
    cluster = Cluster(tiny_target, None, coordinator_overrides={"tree_nodes": 8})
    trees = []
    to_work = cluster.target_servicer.to_work

    def recording(request):  # what the target was asked: a spy, the real servicer does the work
        work = to_work(request)
        trees.append(work.parents)
        return work

    cluster.target_servicer.to_work = recording
    cluster.trees = trees
    yield cluster
    cluster.close()


@pytest.mark.parametrize("proposer", ["lookup", "suffix"])
@pytest.mark.parametrize("k", [3, None])
def test_greedy_with_trees_equals_target_generate(tree_cluster, tiny_target_model, proposer, k):
    del tree_cluster.trees[:]
    with Client(tree_cluster.address) as client:
        for prompt in PROMPTS:
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer=proposer)
            assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
    branching = [p for p in tree_cluster.trees if p and len(set(p)) < len(p)]  # some node has two children
    if k is not None:  # (adaptive K may cut a tree to its first nodes)
        assert branching, ("no branching tree reached the target", tree_cluster.trees)


def test_a_warm_suffix_tree_is_accepted_through_trees(tree_cluster, tiny_target_model):
    """The tiny random target never repeats its prompt, so acceptance comes from the shared suffix tree:
    the second run of a prompt is proposed (as trees) from the first run's output and accepted."""
    del tree_cluster.trees[:]
    prompt = [1, 2115, 253, 9038, 30, 4193, 77]
    expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
    with Client(tree_cluster.address) as client:
        first = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=6, proposer="suffix")
        tree_cluster._call(tree_cluster.pipeline.settle())  # its output joins the shared tree
        second = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=6, proposer="suffix")
    assert first.token_ids == second.token_ids == expected
    assert second.stats["accepted_tokens"] >= len(expected) // 2, second.stats
    assert second.stats["rounds"] < len(expected) // 2
    assert any(tree_cluster.trees), "the drafts went as trees"


@pytest.mark.parametrize("proposer", ["lookup", "suffix"])
def test_seeded_sampling_through_trees_is_reproducible(tree_cluster, proposer):
    with Client(tree_cluster.address) as client:
        runs = [client.generate(token_ids=REPETITIVE, max_new_tokens=MAX_NEW, num_speculative_tokens=4,
                                proposer=proposer, temperature=0.8, seed=seed, ignore_eos=True).token_ids
                for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and len(runs[0]) == MAX_NEW
    assert runs[0] != runs[2]
