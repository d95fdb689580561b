"""A token tree's growth in the draft tier: its shape (N nodes, D levels, b children per expanded node, how
siblings are drawn), each node's draw key and seed, and Growth, which expands nodes level by level from the
draft's distributions and keeps the N likeliest (a dynamic tree) or every drawn node (a sampled one). The
work that feeds the draft and answers a request with a grown tree is specdec.engine.propose_tree."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT
from specdec.math.keyed_draws import keyed_exponential, split_seeds
from specdec.math.seeds import mix64

GREEDY = "greedy"  # a greedy request's tree: the top-b tokens, no q
NODE_STREAM_SALT = 0x5DEECE66D  # mixed into a node key before it salts a position's seed


@dataclass(frozen=True)
class TreeShape:
    nodes: int  # N: node budget
    depth: int  # D: levels at most
    branching: int  # b: children per expanded node, and nodes expanded per level
    scheme: str  # GREEDY, CANDIDATES, IID or WITHOUT_REPLACEMENT

    @property
    def sends_q(self) -> bool:
        return self.scheme in (IID, WITHOUT_REPLACEMENT)


def node_seed(seed: int, key: int) -> int:
    """The draft seed whose keyed draws (specdec.math.keyed_draws: a function of (seed, position, token)) decide
    the draws keyed `key`; key 0 is the session's own seed, so the first-child spine draws as the chain does."""
    return seed if key == 0 else mix64(seed ^ mix64(key + NODE_STREAM_SALT)) >> 1


def child_key(key: int, j: int) -> int:
    """The draw key of child j of the node with key `key` (the first child keeps it)."""
    return key if j == 0 else mix64((key << 8) + j) | 1


Dist = tuple[torch.Tensor, torch.Tensor]  # (token_ids [n], probs [n]) on the host, most likely first


class Growth:
    """One proposal grown below an anchor: the request's tree (anchor -1: the last committed token) or a
    pre-drafted next round (anchor: an outcome node of the speculation cache, a slot node)."""

    def __init__(self, shape: TreeShape, anchor: int, first_pos: int, dynamic: bool = False) -> None:
        self.shape = shape
        self.dynamic = dynamic and shape.branching > 1  # deterministic children: grow past N, keep the N best
        self.anchor = anchor  # slot node the tree hangs below; -1 = the last committed token
        self.first_pos = first_pos  # absolute position of the anchor's children
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1 = the anchor
        self.rows: list[Dist] = []  # the q row each node was drawn from (sampled schemes)
        self.prob: list[float] = []  # the draft's probability of the node's path from the anchor
        self.key: list[int] = []  # draw keys
        self.depth: list[int] = []
        self.slot: list[int] = []  # the node's slot node, -1 = not fed
        self.levels = 0
        self.done = False

    def expand(self, node: int, dist: Dist, seed: int, greedy_logits: bool) -> list[int]:
        """Make node's children (node -1: the anchor's) from its distribution; returns their indices."""
        s = self.shape
        b = s.branching if self.dynamic else min(s.branching, s.nodes - len(self.tokens))
        if b <= 0:
            return []
        ids, probs = dist
        depth = 0 if node < 0 else self.depth[node] + 1
        key = 0 if node < 0 else self.key[node]
        base_prob = 1.0 if node < 0 else self.prob[node]
        if s.scheme in (GREEDY, CANDIDATES) or greedy_logits:
            picks = list(range(min(b, len(ids))))  # the top-b (dist is sorted, most likely first)
        else:
            position = torch.tensor([self.first_pos + depth])

            def race(k: int) -> torch.Tensor:  # q / E with E keyed by (seed of key k, position, token)
                return probs / keyed_exponential(split_seeds([node_seed(seed, k)], "cpu"), position, ids[None])[0]

            if s.scheme == IID:  # child j raced with its own key: independent draws, child 0 the chain's
                picks = [int(race(child_key(key, j)).argmax()) for j in range(b)]
            else:  # without replacement: the race's order (Gumbel-top-k), whose first is the chain's draw
                picks = torch.argsort(race(key), descending=True)[: min(b, len(ids))].tolist()
        made = []
        tokens, values = ids.tolist(), probs.tolist()
        for j, pick in enumerate(picks):
            self.tokens.append(tokens[pick])
            self.parents.append(node)
            self.rows.append(dist)
            self.prob.append(base_prob * values[pick])
            self.key.append(child_key(key, j))
            self.depth.append(depth)
            self.slot.append(-1)
            made.append(len(self.tokens) - 1)
        return made

    def to_expand(self, level: list[int]) -> list[int]:
        """Of a level just made, the nodes whose children the next level holds (empty: the tree is done)."""
        self.levels += 1
        s = self.shape
        if self.dynamic:  # only nodes whose descendants could still be among the N best
            bar = self._nth_best()
            level = [i for i in level if self.prob[i] > bar]
            count = s.branching
        else:  # within the budget
            count = min(s.branching, math.ceil(max(s.nodes - len(self.tokens), 0) / s.branching))
        if self.levels >= s.depth or count <= 0 or not level:
            self.done = True
            return []
        return sorted(sorted(level, key=lambda i: -self.prob[i])[:count])

    def _nth_best(self) -> float:
        """The N-th highest path probability among the nodes (0 while there are fewer than N)."""
        n = self.shape.nodes
        return sorted(self.prob, reverse=True)[n - 1] if len(self.prob) >= n else 0.0

    def keep_best(self) -> None:
        """A dynamic tree's proposal: the N nodes of highest path probability (ties to the earlier node), in
        their order, parents renumbered. A no-op for a tree within its budget."""
        if len(self.tokens) <= self.shape.nodes:
            return
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.prob[i], i))[: self.shape.nodes])
        index = {old: new for new, old in enumerate(keep)}
        self.parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        for name in ("tokens", "rows", "prob", "key", "depth", "slot"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])

    def path(self, node: int) -> tuple[int, ...]:
        """The tokens from the anchor down to node, node's own last."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(out))

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self.tokens)) if i not in has_child]
