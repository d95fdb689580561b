"""The coordinator's draft-tree policy (coordinator.proposers.draft_tree): the tree shape N(D) = b + b^2 (D - 1)
within the budget, a fixed K asked as the tree of depth K, trees only where their expected tokens per unit
of time beat the chosen chain's (flat verification: yes; verification that grows with the nodes scored or
trees whose levels keep failing: no), and the request fields (a chain with the speculation cache is a tree
of branching 1)."""

from __future__ import annotations

from coordinator.proposers.adaptive import AdaptiveConfig, SourceEstimate
from coordinator.proposers.draft_tree import DraftTreeConfig, DraftTreePolicy, TreeAsk
from specdec.proto import draft_pb2, target_pb2

ADAPTIVE = AdaptiveConfig()


def line(intercept: float, slope: float, n: int = 16) -> list[float]:
    """Predicted verify times of rounds scoring 0..n drafts."""
    return [intercept + slope * k for k in range(n + 1)]


def chain(acceptance: float) -> SourceEstimate:
    est = SourceEstimate(ADAPTIVE, local_proposer=False)
    for _ in range(40):
        est.observe_acceptance(10, 0)  # forget the prior
    for i in range(200):  # successes spread evenly (the estimate is exponentially weighted)
        est.observe_acceptance(1, 1 if (i % 10) < 10 * acceptance else 0)
    return est


def test_shape_and_fixed_k():
    trees = DraftTreePolicy(DraftTreeConfig(max_nodes=12, branching=2), ADAPTIVE)
    assert [trees.nodes(d) for d in (1, 2, 3, 4)] == [2, 6, 10, 12]
    flat = line(50.0, 0.0)
    assert trees.choose(chain(0.3), flat, k=3, max_k=3, max_nodes=16, fixed=True) == TreeAsk(10, 3, 2)
    assert trees.choose(chain(0.3), flat, k=3, max_k=3, max_nodes=8, fixed=True) is None  # over the tier's cap
    assert DraftTreePolicy(DraftTreeConfig(max_nodes=0), ADAPTIVE).choose(chain(0.3), flat, 3, 3, 16) is None


def test_trees_only_where_they_pay():
    trees = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE)
    low = chain(0.3)
    assert 0.15 < low.acceptance < 0.45
    assert trees.choose(low, line(50.0, 0.1), k=2, max_k=8, max_nodes=16) is not None  # flat verify: a tree pays
    assert trees.choose(low, line(10.0, 30.0), k=1, max_k=8, max_nodes=16) is None  # each node costs a lot: the chain
    for _ in range(30):
        trees.observe(depth=3, accepted=0)  # measured: the trees' levels fail
    assert trees.rounds == 30 and trees.levels.acceptance < 0.1
    assert trees.choose(low, line(50.0, 0.1), k=2, max_k=8, max_nodes=16) is None


def test_request_fields():
    with_cache = DraftTreePolicy(DraftTreeConfig(max_nodes=8, branching=3, scheme="iid", speculate=4), ADAPTIVE)
    r = draft_pb2.ProposeRequest(num_tokens=3)
    with_cache.request_fields(r, None, 3)  # a chain, with the speculation cache: a tree of branching 1
    assert (r.tree_nodes, r.tree_depth, r.tree_branching, r.speculate) == (3, 3, 1, 4)
    r = draft_pb2.ProposeRequest(num_tokens=2)
    with_cache.request_fields(r, TreeAsk(8, 2, 3), 2)
    assert (r.tree_nodes, r.tree_depth, r.tree_branching, r.tree_scheme) == (8, 2, 3, target_pb2.TREE_SCHEME_IID)
    plain = DraftTreePolicy(DraftTreeConfig(max_nodes=8), ADAPTIVE)
    r = draft_pb2.ProposeRequest(num_tokens=3)
    plain.request_fields(r, None, 3)
    assert r.tree_nodes == 0 and r.speculate == 0
