"""The draft model's token trees: which shape (node budget N, depth D) a round asks for, and what it predicts:
E = 1 + rho x (the walk's chances of reaching the shape's nodes, from the sibling acceptance vector c_r) at
(verify(N) + propose(D)) x kappa (docs/DESIGN.md, Token trees, has the derivation)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from coordinator.proposers.estimates import Ratio, SharedPriors
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.proposers.token_tree import children
from specdec.proto import draft_pb2, target_pb2

SCHEMES = {"without_replacement": target_pb2.TREE_SCHEME_WITHOUT_REPLACEMENT, "iid": target_pb2.TREE_SCHEME_IID,
           "candidates": target_pb2.TREE_SCHEME_CANDIDATES}


@dataclass(frozen=True)
class DraftTreeConfig:
    max_nodes: int = 0  # the draft model's node budget per tree (0 = chains only)
    branching: int = 2  # children per expanded node, and nodes expanded per level
    scheme: str = "without_replacement"  # how a sampled tree's siblings are drawn: without_replacement | iid | candidates
    speculate: int = 0  # the speculation cache: outcomes the draft pre-drafts the next round for (0 = off)

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.branching < 1 or self.speculate < 0 or self.scheme not in SCHEMES:
            raise ValueError(f"bad draft tree settings: {self}")


@dataclass(frozen=True)
class TreeAsk:
    nodes: int  # N
    depth: int  # D
    branching: int  # b (1: a chain, asked as a tree for the speculation cache), at most N (the draft tier's rule)

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= self.nodes or not 1 <= self.branching <= self.nodes:
            raise ValueError(f"not a tree the draft tier takes: {self}")


class SiblingAcceptance:
    """c_r, r = 0 .. b - 1: per session, the levels where the r-th child (the draft's order) held the target's
    token over those where it was tried, exponentially weighted. Prior (worth PRIOR_LEVELS levels): the vector
    earlier sessions learnt, else c_0 = the chain's acceptance a and c_r = a / 2^r."""

    PRIOR_LEVELS = 2.0

    def __init__(self, branching: int, decay: float, prior: list[float] | None = None) -> None:
        self.decay = decay
        self.prior = prior if prior is not None and len(prior) == branching else None
        self.hits = [0.0] * branching
        self.tries = [0.0] * branching
        self.levels = 0  # levels observed

    def conditional(self, a: float) -> list[float]:
        """c_r given the chain's acceptance a (the prior's scale)."""
        w = self.PRIOR_LEVELS
        prior = self.prior or [a / 2 ** r for r in range(len(self.hits))]
        return [(h + w * c) / (t + w) for c, h, t in zip(prior, self.hits, self.tries)]

    def path_probs(self, a: float) -> list[float]:
        """p_r = c_r (1 - c_0) ... (1 - c_{r-1}): the chance that the walk goes on through child r."""
        out, missed = [], 1.0
        for c in self.conditional(a):
            out.append(missed * c)
            missed *= 1.0 - c
        return out

    def observe(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """A verified tree and its accepted path, root-down: at each level the children before the one that
        held were tried and missed; where the walk stopped, every child missed."""
        below = children(parents)
        self.hits = [h * self.decay for h in self.hits]
        self.tries = [t * self.decay for t in self.tries]
        node = -1
        for level in range(len(path) + 1):
            kids = below.get(node, [])[: len(self.hits)]
            if not kids:
                break
            held = kids.index(path[level]) if level < len(path) and path[level] in kids else len(kids)
            for r in range(min(held + 1, len(kids))):
                self.tries[r] += 1.0
            if held < len(kids):
                self.hits[held] += 1.0
            self.levels += 1
            if level == len(path):
                break
            node = path[level]


def best_first(p: Sequence[float], nodes: int, depth: int) -> list[float]:
    """A dynamic tree's nodes' chances of being reached, best first: the N likeliest within `depth` levels,
    child r reached with its parent's chance times p[r]."""
    heap = [(-pr, 1) for pr in p if pr > 0]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < nodes:
        v, d = heapq.heappop(heap)
        out.append(-v)
        if d < depth:
            for pr in p:
                if pr > 0:
                    heapq.heappush(heap, (v * pr, d + 1))
    return out


def level_growth(p: Sequence[float], nodes: int, depth: int) -> list[float]:
    """The same for a sampled tree's shape (specdec.engine.tree_growth.Growth): the root's b children, then per
    level the likeliest ceil(left / b) (at most b) nodes' b children each, until N nodes or D levels."""
    b, out, level = len(p), [], [1.0]
    for _ in range(depth):
        left = nodes - len(out)
        if left <= 0 or not level:
            break
        expand = sorted(level, reverse=True)[: min(b, -(-left // b))]
        level = [v * pr for v in expand for pr in p][:left]
        out.extend(level)
    return out


MIN_LEVELS = 4  # tree levels a session must have judged for its tree estimates to teach the shared priors


class DraftTrees:
    """Per session: the tree shape of each draft-model round, and what tree rounds have taught."""

    def __init__(self, config: DraftTreeConfig, decay: float, greedy: bool = True,
                 priors: SharedPriors | None = None) -> None:
        """greedy (or the candidates scheme): the trees are dynamic, their N chosen freely. priors: where the
        estimates start (None: the defaults)."""
        self.config, self.greedy, self.priors = config, greedy, priors
        self.dynamic = greedy or config.scheme == "candidates"
        learnt = (lambda name, default: priors.get(DRAFT_MODEL, greedy, name, default)) if priors else (lambda n, d: d)
        self.siblings = SiblingAcceptance(max(config.branching, 1), decay, learnt("siblings", None))
        self.ratio = Ratio(decay, prior=learnt("rho", 1.0))  # rho: nodes accepted / the sum the vector predicted
        self.cost_ratio = Ratio(decay, prior=learnt("kappa", 1.0))  # kappa: a round's time / the time predicted
        self._asked = (0.0, 0.0)  # the sum the vector predicted for the tree last asked for, and its time (ms)

    def nodes(self, depth: int) -> int:
        """N(D): a tree of depth D's nodes when every level fills (a sampled tree's; a fixed K's)."""
        b = self.config.branching
        return min(self.config.max_nodes, b + b * b * (depth - 1))

    def reach(self, a: float, nodes: int, depth: int) -> float:
        """The vector's sum over a tree of N nodes and depth D (chain acceptance a): its accepted nodes, unscaled."""
        p = self.siblings.path_probs(a)
        return sum(best_first(p, nodes, depth) if self.dynamic else level_growth(p, nodes, depth))

    def expected(self, a: float, nodes: int, depth: int) -> float:
        """E(N, D): tokens a round with this tree commits (the bonus included), for chain acceptance a."""
        return 1.0 + self.ratio.value * self.reach(a, nodes, depth)

    def fixed(self, k: int, a: float, max_nodes: int) -> TreeAsk | None:
        """A request's fixed K as a tree, whatever the timings: depth K, N(K) nodes (None: a chain, where N(K)
        <= K or over max_nodes)."""
        n = self.nodes(k)
        if self.config.branching <= 1 or not k < n <= max_nodes:
            return None
        return TreeAsk(n, k, self.config.branching)

    def best(self, a: float, propose: Callable[[int], float], verify: Sequence[float], max_k: int,
             max_nodes: int) -> tuple[float, float, TreeAsk] | None:
        """(E, its round's ms, the tree) of most expected tokens per ms, at most max_k deep and max_nodes large
        (None: no tree). propose(D): the draft's ms for D levels; verify[n]: the target's for n drafts."""
        c = self.config
        limit = min(c.max_nodes, max_nodes, len(verify) - 1)
        if limit <= 1 or c.branching <= 1:
            return None
        p, rho, kappa = self.siblings.path_probs(a), self.ratio.value, self.cost_ratio.value
        best = None
        for depth in range(1, max_k + 1):
            if self.dynamic:  # every N from depth + 1 (a chain's N is its depth) to the budget
                reach = list(accumulate(best_first(p, limit, depth)))
                shapes = [(n, reach[n - 1]) for n in range(depth + 1, len(reach) + 1)]
            else:  # the shape the draft grows
                n = self.nodes(depth)
                shapes = [(n, sum(level_growth(p, n, depth)))] if depth < n <= limit else []
            for n, r in shapes:
                cost = (verify[n] + propose(depth)) * kappa
                if best is None or (1.0 + rho * r) / cost > best[0]:  # b <= N: the N best nodes use no child past N
                    best = ((1.0 + rho * r) / cost, r, cost, TreeAsk(n, depth, min(c.branching, n)))
        if best is None:
            return None
        return 1.0 + rho * best[1], best[2], best[3]

    def asked(self, tree: TreeAsk, a: float, cost_ms: float) -> None:
        """The tree a round asks for and its predicted time (0: a fixed K's): what its outcome is judged by."""
        self._asked = (self.reach(a, tree.nodes, tree.depth), cost_ms / max(self.cost_ratio.value, 1e-9))

    def observe(self, parents: Sequence[int], path: Sequence[int], round_ms: float = 0.0) -> None:
        """A tree round: its parents, the accepted path (node indices) and its wall time (0: not timed)."""
        reach, predicted_ms = self._asked
        if reach > 0:
            self.ratio.observe(len(path), reach)
        if predicted_ms > 0 and round_ms > 0:
            self.cost_ratio.observe(round_ms, predicted_ms)
        self.siblings.observe(parents, path)

    def teach(self, a: float) -> None:
        """At the session's end: what its trees measured, to the shared priors (after MIN_LEVELS levels)."""
        if self.priors is not None and self.siblings.levels >= MIN_LEVELS:
            self.priors.learn(DRAFT_MODEL, self.greedy, siblings=self.siblings.conditional(a), rho=self.ratio.value,
                              kappa=self.cost_ratio.value)

    def request_fields(self, request: draft_pb2.ProposeRequest, tree: TreeAsk | None, k: int,
                       runs_on: bool = False) -> None:
        """A ProposeRequest's tree and speculation fields: the tree, or with the speculation cache on a chain
        asked as a tree of branching 1 (a chain request has no cache). runs_on: the round lets the target run on,
        so the next round starts past tokens no pre-drafted outcome holds: no speculation (a chain stays a chain)."""
        speculate = 0 if runs_on else self.config.speculate
        if tree is None and speculate <= 0:
            return
        tree = tree or TreeAsk(k, k, 1)
        request.tree_nodes, request.tree_depth, request.tree_branching = tree.nodes, tree.depth, tree.branching
        request.tree_scheme = SCHEMES[self.config.scheme]
        request.speculate = speculate
