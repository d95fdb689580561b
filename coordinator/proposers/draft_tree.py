"""The draft model's token trees as the coordinator asks for them: which tree shape (node budget N, depth D)
a round asks for, from measured acceptance and measured costs, and the speculation cache's request fields.

The draft grows a tree by expanding the b likeliest nodes of each level with b children each
(specdec.engine.propose_tree), so a tree of depth D has N(D) = min(max_nodes, b + b^2 (D - 1)) nodes (a greedy
tree is dynamic: it grows all b + b^2 (D - 1) candidates and keeps the N(D) likeliest). A tree
round commits E(D) = (1 - a_t^(D+1)) / (1 - a_t) tokens for a per-level acceptance a_t (the walk goes one
level deeper), measured on the session's tree rounds (exponentially weighted, as the chain's a), with the
prior 1 - (1 - a)^b from the chain's a (a level holds when one of b siblings is right). It costs
verify(N(D)) + propose(D): the target's measured verify line against tokens scored (shared with the chains,
from the target's load) and the draft's measured propose line against its steps (one per level, as a
chain's K). A tree is asked for only when the policy chose the draft model for a chain of K > 0 and the
best tree's E / C beats that chain's: never where the policy would run K = 0 (the target alone). A request
with a fixed K asks for the tree of depth K (N(K) nodes), so that its proposals depend on no timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.proposers.adaptive import AdaptiveConfig, SourceEstimate, expected_tokens
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
    branching: int  # b (1: a chain, asked as a tree for the speculation cache)


class DraftTreePolicy:
    """Per session: the tree shape of each draft-model round, and what tree rounds have taught."""

    def __init__(self, config: DraftTreeConfig, adaptive: AdaptiveConfig) -> None:
        self.config = config
        self.levels = SourceEstimate(adaptive, local_proposer=False)  # per-level acceptance of tree rounds
        self.rounds = 0

    def nodes(self, depth: int) -> int:
        b = self.config.branching
        return min(self.config.max_nodes, b + b * b * (depth - 1))

    def choose(self, chain: SourceEstimate, verify: Sequence[float], k: int, max_k: int, max_nodes: int,
               measured: bool = True, fixed: bool = False) -> TreeAsk | None:
        """The tree to ask for instead of the chosen chain of k drafts (None: the chain), at most max_k deep
        and max_nodes large. chain: the draft model's estimates; verify[n]: the predicted verify time of
        a round scoring n drafts (n = 0..max_nodes). fixed: the request set K, which is then the tree's depth (its
        nodes: N(K)), no timing involved."""
        c = self.config
        if c.max_nodes <= 1 or c.branching <= 1 or k <= 0:
            return None
        if fixed:
            n = self.nodes(k)
            return TreeAsk(n, k, c.branching) if k < n <= max_nodes else None
        p0, p1 = chain.propose_cost.line(measured)
        a = chain.acceptance
        best_rate = expected_tokens(a, k) / (verify[k] + max(p0 + p1 * k, 1e-6))
        a_t = self.levels.acceptance if self.rounds else 1.0 - (1.0 - a) ** c.branching
        best = None
        for depth in range(1, max_k + 1):
            n = self.nodes(depth)
            if n < depth or n > max_nodes or n >= len(verify):
                break
            rate = expected_tokens(a_t, depth) / (verify[n] + max(p0 + p1 * depth, 1e-6))
            if rate > best_rate:
                best_rate, best = rate, TreeAsk(n, depth, c.branching)
        return best

    def observe(self, depth: int, accepted: int) -> None:
        """A tree round: `accepted` levels of `depth` held."""
        self.levels.observe_acceptance(depth, accepted)
        self.rounds += 1

    def request_fields(self, request: draft_pb2.ProposeRequest, tree: TreeAsk | None, k: int) -> None:
        """Fill a ProposeRequest's tree and speculation fields: the tree, or with the speculation cache on a
        chain of k asked as a tree of branching 1 (a chain request has no cache)."""
        if tree is None and self.config.speculate <= 0:
            return
        tree = tree or TreeAsk(k, k, 1)
        request.tree_nodes, request.tree_depth, request.tree_branching = tree.nodes, tree.depth, tree.branching
        request.tree_scheme = SCHEMES[self.config.scheme]
        request.speculate = self.config.speculate
