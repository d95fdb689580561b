"""The draft model's trees (coordinator.proposers.draft_tree, priced by the draft-model strategy): Sequoia's acceptance vector counted
exactly from verified trees, the expected tokens of dynamic (best-first) and sampled (level-grown) shapes
computed by hand, N and D chosen freely for dynamic trees and N(D) for sampled ones, a fixed K asked as the
tree of depth K, trees only where their expected tokens per unit of time beat the chosen chain's (flat
verification: a large tree; verification that grows with the nodes scored: a small one or the chain;
trees whose levels keep failing: the chain), the measured ratio lifting the vector's estimate, and the
measured time of tree rounds charged to them, and the request fields (a chain with the speculation cache is a
tree of branching 1)."""

from __future__ import annotations

from coordinator.proposers.draft_model import DraftModelStrategy
from coordinator.proposers.draft_tree import DraftTreeConfig, DraftTrees, SiblingAcceptance, TreeAsk, best_first, level_growth
from coordinator.proposers.estimates import SharedPriors
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.tier_cost import TierCost
from specdec.proto import draft_pb2, target_pb2
from tests.proposer_fakes import ask, draft

DECAY = 0.9


def PROPOSE(depth: int) -> float:
    """The draft's prior price of `depth` steps (ms)."""
    return 1.0 + 5.0 * depth


def line(intercept: float, slope: float, n: int = 16) -> list[float]:
    """Predicted verify times of rounds scoring 0..n drafts."""
    return [intercept + slope * k for k in range(n + 1)]


def chain(acceptance: float, trees: DraftTrees | None = None) -> DraftModelStrategy:
    """A draft-model strategy whose chains have this acceptance."""
    d = draft(trees=trees)
    for _ in range(40):
        d.acceptance.judge(10, 0)  # forget the prior
    for i in range(200):  # successes spread evenly (the estimate is exponentially weighted)
        d.acceptance.judge(1, 1 if (i % 10) < 10 * acceptance else 0)
    return d


def a(acceptance: float) -> float:
    return chain(acceptance).acceptance.value


def session(acceptance: float, intercept: float, slope: float, trees: DraftTrees | None = None):
    """A draft-model strategy with this acceptance, and a target whose verify of n drafts measured intercept + slope n."""
    cost = TierCost()
    for _ in range(60):
        for n in (0, 2, 8, 16):
            cost.observe(0, 0, 0.0, intercept + slope * n, drafts=n)
    return chain(acceptance, trees), cost


def choose(strategy: DraftModelStrategy, cost: TierCost, k: int = 8, fixed: bool = False):
    return Policy(PolicyConfig()).choose([strategy], ask(cost, k, nodes=16, fixed=fixed))


def test_shape_and_fixed_k():
    trees = DraftTrees(DraftTreeConfig(max_nodes=12, branching=2), DECAY)
    assert [trees.nodes(d) for d in (1, 2, 3, 4)] == [2, 6, 10, 12]
    assert trees.fixed(3, 0.3, max_nodes=16) == TreeAsk(10, 3, 2)
    assert trees.fixed(3, 0.3, max_nodes=8) is None  # over the tier's cap
    assert DraftTrees(DraftTreeConfig(max_nodes=0), DECAY).fixed(3, 0.3, 16) is None
    assert DraftTrees(DraftTreeConfig(max_nodes=0, speculate=4), DECAY).best(0.3, PROPOSE, line(50.0, 0.0), 8, 16) is None


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
    low = a(0.3)
    assert 0.15 < low < 0.45
    greedy = DraftTrees(DraftTreeConfig(max_nodes=16, branching=4), DECAY)
    _, _, flat = greedy.best(low, PROPOSE, line(100.0, 0.0), max_k=8, max_nodes=16)
    assert flat.nodes == 16 and flat.depth >= 2  # nodes cost nothing: the whole budget
    steep_after_8 = [100.0 if n <= 8 else 100.0 + 20.0 * (n - 8) for n in range(17)]
    _, _, mid = greedy.best(low, PROPOSE, steep_after_8, max_k=8, max_nodes=16)
    assert mid.nodes == 8  # not a node past the flat part, and not N(D) = 4 or 16
    steep_after_2 = [100.0 if n <= 2 else 100.0 + 50.0 * (n - 2) for n in range(17)]
    assert greedy.best(low, PROPOSE, steep_after_2, 8, 16)[2] in (TreeAsk(2, 1, 2), TreeAsk(2, 2, 2))  # b <= N
    sampled = DraftTrees(DraftTreeConfig(max_nodes=16, branching=4), DECAY, greedy=False)
    assert sampled.best(low, PROPOSE, steep_after_8, max_k=8, max_nodes=16)[2] == TreeAsk(4, 1, 4)  # N(D) only
    assert sampled.best(low, PROPOSE, line(100.0, 0.0), max_k=8, max_nodes=16)[2].nodes == 16


def test_trees_compete_with_chains_and_with_the_target_alone():
    trees = DraftTrees(DraftTreeConfig(max_nodes=16, branching=4), DECAY)
    weak, cost = session(0.3, 30.0, 0.0)
    assert weak.acceptance.value < 0.25
    assert choose(weak, cost) is None  # no chain pays: the target alone
    weak.trees = trees
    choice = choose(weak, cost)
    assert choice is not None and choice.nodes > choice.k  # a tree does
    steep, steep_cost = session(0.3, 10.0, 30.0, trees)  # each node scored costs three steps' worth
    assert not getattr(choose(steep, steep_cost), "nodes", 0)
    weak.session.available = False
    assert choose(weak, cost) is None  # no draft: no tree
    weak.session.available = True
    fixed = choose(weak, cost, k=3, fixed=True)  # a request's K: the tree of depth K with N(K) nodes, whatever the timings
    assert (fixed.k, fixed.nodes) == (3, trees.nodes(3)) and fixed.by is weak


def test_failing_levels_turn_trees_off_and_good_ones_raise_the_estimate():
    trees = DraftTrees(DraftTreeConfig(max_nodes=16, branching=2), DECAY)
    d, cost = session(0.3, 50.0, 0.1, trees)
    low = d.acceptance.value
    tree = [-1, -1, 0, 0, 1, 1]  # depth 2, two children per node
    assert choose(d, cost).nodes  # flat verify: a tree pays
    for _ in range(30):
        trees.asked(TreeAsk(6, 2, 2), low, 0.0)
        trees.observe(tree, [])  # measured: no child of the root ever holds
    assert trees.siblings.conditional(low)[0] < 0.1 and trees.ratio.value < 0.2
    assert not getattr(choose(d, cost), "nodes", 0)
    lucky = DraftTrees(DraftTreeConfig(max_nodes=16, branching=2), DECAY)
    before = lucky.expected(0.3, 6, 2)
    for _ in range(30):
        lucky.asked(TreeAsk(6, 2, 2), low, 0.0)
        lucky.observe(tree, [0, 2])  # the first child, then its first child: both levels held every time
    assert lucky.ratio.value > 1.0 and lucky.expected(0.3, 6, 2) > before


def test_trees_slower_than_predicted_are_charged_their_measured_time():
    trees = DraftTrees(DraftTreeConfig(max_nodes=16, branching=4), DECAY)
    d, cost = session(0.3, 30.0, 0.0, trees)
    choice = choose(d, cost)
    assert choice.nodes
    trees.asked(TreeAsk(choice.nodes, choice.k, choice.branching), d.acceptance.value, choice.cost_ms)
    predicted = trees._asked[1]
    assert predicted > 30.0
    for _ in range(20):  # each tree round takes twice its predicted time (its nodes accepted as predicted)
        _, time_ms, tree = trees.best(d.acceptance.value, d.propose_ms(), cost.verify_ms(16), 8, 16)
        trees.asked(tree, d.acceptance.value, time_ms)
        trees.observe([-1, -1, -1, -1], [0], round_ms=2 * trees._asked[1])
    assert 1.8 < trees.cost_ratio.value <= 2.0
    assert not getattr(choose(d, cost), "nodes", 0)


def test_request_fields():
    with_cache = DraftTrees(DraftTreeConfig(max_nodes=8, branching=3, scheme="iid", speculate=4), DECAY)
    r = draft_pb2.ProposeRequest(num_tokens=3)
    with_cache.request_fields(r, None, 3)  # a chain, with the speculation cache: a tree of branching 1
    assert (r.tree_nodes, r.tree_depth, r.tree_branching, r.speculate) == (3, 3, 1, 4)
    r = draft_pb2.ProposeRequest(num_tokens=2)
    with_cache.request_fields(r, TreeAsk(8, 2, 3), 2)
    assert (r.tree_nodes, r.tree_depth, r.tree_branching, r.tree_scheme) == (8, 2, 3, target_pb2.TREE_SCHEME_IID)
    plain = DraftTrees(DraftTreeConfig(max_nodes=8), DECAY)
    r = draft_pb2.ProposeRequest(num_tokens=3)
    plain.request_fields(r, None, 3)
    assert r.tree_nodes == 0 and r.speculate == 0


def test_sessions_teach_their_trees_to_the_next():
    """A session's sibling vector, rho and kappa join the coordinator's priors at its end (once judged on
    enough levels), and the next session of the same kind (greedy here) starts from them; sampled sessions
    and a session with too few levels learn nothing from it."""
    priors = SharedPriors()
    first = DraftTrees(DraftTreeConfig(max_nodes=16, branching=2), DECAY, greedy=True, priors=priors)
    first.teach(0.3)
    assert priors.get(DRAFT_MODEL, True, "siblings") is None  # no level judged yet
    for _ in range(10):
        _, cost, tree = first.best(a(0.3), PROPOSE, line(50.0, 0.1), max_k=2, max_nodes=16)
        first.asked(tree, a(0.3), cost)
        first.observe([-1, -1, 0, 0, 1, 1], [1], round_ms=3 * first._asked[1])  # the second child holds; slow rounds
    first.teach(0.3)
    vector, rho, kappa = (priors.get(DRAFT_MODEL, True, name) for name in ("siblings", "rho", "kappa"))
    assert vector == first.siblings.conditional(0.3) and vector[1] > vector[0] and kappa > 2.0
    assert priors.get(DRAFT_MODEL, False, "siblings") is None
    second = DraftTrees(DraftTreeConfig(max_nodes=16, branching=2), DECAY, greedy=True, priors=priors)
    assert second.siblings.conditional(0.3) == vector  # nothing of its own yet: exactly the prior
    assert (second.ratio.value, second.cost_ratio.value) == (rho, kappa)
    fresh = DraftTrees(DraftTreeConfig(max_nodes=16, branching=2), DECAY, greedy=False, priors=priors)
    assert fresh.siblings.conditional(0.3) == [0.3, 0.15] and fresh.cost_ratio.value == 1.0
