"""The coordinator's draft-tree policy (coordinator.proposers.draft_tree): Sequoia's acceptance vector counted
exactly from verified trees, the expected tokens of dynamic (best-first) and sampled (level-grown) shapes
computed by hand, N and D chosen freely for dynamic trees and N(D) for sampled ones, a fixed K asked as the
tree of depth K, trees only where their expected tokens per unit of time beat the chosen chain's (flat
verification: a large tree; verification that grows with the nodes scored: a small one or the chain;
trees whose levels keep failing: the chain), the measured ratio lifting the vector's estimate, and the
measured time of tree rounds charged to them, and the request fields (a chain with the speculation cache is a
tree of branching 1)."""

from __future__ import annotations

from coordinator.proposers.adaptive import AdaptiveConfig, SourceEstimate, SourcePriors
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.policy import ProposerPolicy
from coordinator.proposers.draft_tree import (DraftTreeConfig, DraftTreePolicy, SiblingAcceptance, TreeAsk, best_first,
                                              level_growth)
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
    assert trees.fixed(3, 0.3, max_nodes=16) == TreeAsk(10, 3, 2)
    assert trees.fixed(3, 0.3, max_nodes=8) is None  # over the tier's cap
    assert DraftTreePolicy(DraftTreeConfig(max_nodes=0), ADAPTIVE).fixed(3, 0.3, 16) is None
    assert DraftTreePolicy(DraftTreeConfig(max_nodes=0, speculate=4), ADAPTIVE).best(chain(0.3), line(50.0, 0.0), 8, 16) is None


def test_sibling_acceptance_counts_each_level_of_the_walk():
    s = SiblingAcceptance(3, decay=1.0)
    # root -> 0, 1, 2; node 0 -> 3, 4; node 1 -> 5. The walk took child 1 of the root, then node 1's only child.
    s.observe([-1, -1, -1, 0, 0, 1], [1, 5])
    assert (s.hits, s.tries, s.levels) == ([1.0, 1.0, 0.0], [2.0, 1.0, 0.0], 2)
    s.observe([-1, -1, -1, 0, 0, 1], [])  # every child of the root missed
    assert (s.hits, s.tries) == ([1.0, 1.0, 0.0], [3.0, 2.0, 1.0])
    s.observe([-1, 0, 0], [0])  # the root's child held, both of its children missed
    assert (s.hits, s.tries) == ([2.0, 1.0, 0.0], [5.0, 3.0, 1.0])
    w, a = SiblingAcceptance.PRIOR_LEVELS, 0.3
    c = s.conditional(a)
    assert c == [(2 + w * a) / (5 + w), (1 + w * a / 2) / (3 + w), (0 + w * a / 4) / (1 + w)]
    p = s.path_probs(a)
    assert p[0] == c[0] and abs(p[1] - (1 - c[0]) * c[1]) < 1e-12 and abs(p[2] - (1 - c[0]) * (1 - c[1]) * c[2]) < 1e-12
    fresh = SiblingAcceptance(4, decay=0.9).path_probs(0.3)  # the prior: top 4 hold ~47% (the replay: ~50%)
    assert abs(fresh[0] - 0.3) < 1e-12 and 0.45 < sum(fresh) < 0.5


def test_shapes_expected_reach_by_hand():
    assert best_first([0.5, 0.25], nodes=3, depth=2) == [0.5, 0.25, 0.25]
    assert best_first([0.5, 0.25], nodes=5, depth=1) == [0.5, 0.25]  # depth 1: the root's children only
    assert best_first([0.5, 0.25], nodes=4, depth=3) == [0.5, 0.25, 0.25, 0.125]
    # sampled: the root's 2, then ceil(3 / 2) = 2 nodes expanded with 2 children each, cut at 5 nodes
    assert level_growth([0.5, 0.25], nodes=5, depth=3) == [0.5, 0.25, 0.25, 0.125, 0.125]
    assert level_growth([0.5, 0.25], nodes=8, depth=2) == [0.5, 0.25, 0.25, 0.125, 0.125, 0.0625]


def test_dynamic_trees_choose_nodes_and_depth_sampled_ones_their_grown_shape():
    low = chain(0.3)
    assert 0.15 < low.acceptance < 0.45
    greedy = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=4), ADAPTIVE)
    _, flat = greedy.best(low, line(100.0, 0.0), max_k=8, max_nodes=16)
    assert flat.nodes == 16 and flat.depth >= 2  # nodes cost nothing: the whole budget
    steep_after_8 = [100.0 if n <= 8 else 100.0 + 20.0 * (n - 8) for n in range(17)]
    _, mid = greedy.best(low, steep_after_8, max_k=8, max_nodes=16)
    assert mid.nodes == 8  # not a node past the flat part, and not N(D) = 4 or 16
    steep_after_2 = [100.0 if n <= 2 else 100.0 + 50.0 * (n - 2) for n in range(17)]
    assert greedy.best(low, steep_after_2, max_k=8, max_nodes=16)[1] in (TreeAsk(2, 1, 2), TreeAsk(2, 2, 2))  # b <= N
    sampled = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=4), ADAPTIVE, greedy=False)
    assert sampled.best(low, steep_after_8, max_k=8, max_nodes=16)[1] == TreeAsk(4, 1, 4)  # N(D) only
    assert sampled.best(low, line(100.0, 0.0), max_k=8, max_nodes=16)[1].nodes == 16


def policy(acceptance: float, intercept: float, slope: float) -> ProposerPolicy:
    """A session's proposer policy whose draft chains have this acceptance and whose verify line is measured."""
    pol = ProposerPolicy(ADAPTIVE, (DRAFT_MODEL,))
    pol.estimates[DRAFT_MODEL] = chain(acceptance)
    for _ in range(60):
        for n in (0, 2, 8, 16):
            pol.verify_cost.observe(n, intercept + slope * n)
    return pol


def test_trees_compete_with_chains_and_with_the_target_alone():
    trees = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=4), ADAPTIVE)
    weak = policy(0.3, 30.0, 0.0)
    assert weak.estimates[DRAFT_MODEL].acceptance < 0.25
    assert weak.choose([], 8, draft=True, fixed=False).k == 0  # no chain pays: the target alone
    choice = weak.choose([], 8, draft=True, fixed=False, trees=trees, max_nodes=16)
    assert choice.source == DRAFT_MODEL and choice.tree is not None and choice.k == choice.tree.depth  # a tree does
    steep = policy(0.3, 10.0, 30.0)  # each node scored costs three steps' worth
    assert steep.choose([], 8, draft=True, fixed=False, trees=trees, max_nodes=16).tree is None
    assert weak.choose([], 8, draft=False, fixed=False, trees=trees, max_nodes=16).k == 0  # no draft: no tree
    assert weak.choose([], 3, draft=True, fixed=True, trees=trees, max_nodes=16).tree is None  # a fixed K: the drafter's


def test_failing_levels_turn_trees_off_and_good_ones_raise_the_estimate():
    trees = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE)
    pol = policy(0.3, 50.0, 0.1)
    low = pol.estimates[DRAFT_MODEL]
    tree = [-1, -1, 0, 0, 1, 1]  # depth 2, two children per node
    assert pol.choose([], 8, True, False, trees=trees, max_nodes=16).tree is not None  # flat verify: a tree pays
    for _ in range(30):
        trees.best(low, line(50.0, 0.1), max_k=2, max_nodes=16)
        trees.observe(tree, [])  # measured: no child of the root ever holds
    assert trees.siblings.conditional(low.acceptance)[0] < 0.1 and trees.ratio.value < 0.2
    assert pol.choose([], 8, True, False, trees=trees, max_nodes=16).tree is None
    lucky = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE)
    before = lucky.expected(0.3, 6, 2)
    for _ in range(30):
        lucky.best(low, line(50.0, 0.1), max_k=2, max_nodes=16)
        lucky.observe(tree, [0, 2])  # the first child, then its first child: both levels held every time
    assert lucky.ratio.value > 1.0 and lucky.expected(0.3, 6, 2) > before


def test_trees_slower_than_predicted_are_charged_their_measured_time():
    trees = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=4), ADAPTIVE)
    pol = policy(0.3, 30.0, 0.0)
    choice = pol.choose([], 8, True, False, trees=trees, max_nodes=16)
    assert choice.tree is not None
    predicted = trees._asked[1]
    assert predicted > 30.0
    for _ in range(20):  # each tree round takes twice its predicted time (its nodes accepted as predicted)
        trees.best(pol.estimates[DRAFT_MODEL], pol.verify_costs(16), 8, 16)
        trees.observe([-1, -1, -1, -1], [0], round_ms=2 * trees._asked[1])
    assert 1.8 < trees.cost_ratio.value <= 2.0
    assert pol.choose([], 8, True, False, trees=trees, max_nodes=16).tree is None


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


def test_sessions_teach_their_trees_to_the_next():
    """A session's sibling vector, rho and kappa join the coordinator's priors at its end (once judged on
    enough levels), and the next session of the same kind (greedy here) starts from them; sampled sessions
    and a session with too few levels learn nothing from it."""
    priors = SourcePriors(ADAPTIVE)
    first = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE, greedy=True, priors=priors)
    first.teach(0.3)
    assert priors.trees(True) is None  # no level judged yet
    for _ in range(10):
        first.best(chain(0.3), line(50.0, 0.1), max_k=2, max_nodes=16)
        first.observe([-1, -1, 0, 0, 1, 1], [1], round_ms=3 * first._asked[1])  # the second child holds; slow rounds
    first.teach(0.3)
    vector, rho, kappa = priors.trees(True)
    assert vector == first.siblings.conditional(0.3) and vector[1] > vector[0] and kappa > 2.0
    assert priors.trees(False) is None
    second = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE, greedy=True, priors=priors)
    assert second.siblings.conditional(0.3) == vector  # nothing of its own yet: exactly the prior
    assert (second.ratio.value, second.cost_ratio.value) == (rho, kappa)
    fresh = DraftTreePolicy(DraftTreeConfig(max_nodes=16, branching=2), ADAPTIVE, greedy=False, priors=priors)
    assert fresh.siblings.conditional(0.3) == [0.3, 0.15] and fresh.cost_ratio.value == 1.0
