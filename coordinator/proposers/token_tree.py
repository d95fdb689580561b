"""Token trees as the coordinator builds and reads them, in plain Python (no torch here).

A tree proposal is its nodes in node order: tokens[i] and parents[i] (-1 = a child of the last committed
token, else an earlier node), as specdec.math.tree lays them out and the wire carries them; a chain is
parents [-1, 0, 1, ...]. The model-free proposers build theirs from several candidate continuations
(add_branch merges shared prefixes, as a trie); the round loop reads the accepted path back.
"""

from __future__ import annotations

from collections.abc import Sequence


class TreeBuilder:
    """Continuations merged into one tree (shared prefixes once), at most max_nodes nodes."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_nodes

    def add_branch(self, branch: Sequence[int]) -> None:
        """Add a continuation of the committed tokens, as far as the node budget allows."""
        node = -1
        for t in branch:
            child = self._child.get((node, t))
            if child is None:
                if self.full:
                    return
                child = self.add(node, t)
            node = child

    def add(self, parent: int, token: int) -> int:
        """One node below `parent` (which must exist); returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self._child[(parent, token)] = len(self.tokens) - 1
        return len(self.tokens) - 1


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (0 for a child of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children in node order (key -1: the root's)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def select(keep: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The parents of the nodes `keep` (in node order, each node's parent kept too), renumbered among them."""
    index = {old: new for new, old in enumerate(keep)}
    return [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


def cut(tokens: Sequence[int], parents: Sequence[int], probs: Sequence[float], max_depth: int,
        max_nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The tree's first max_nodes nodes (node order) of depth < max_depth, parents renumbered."""
    kept: set[int] = set()
    for i, (p, d) in enumerate(zip(parents, depths(parents))):
        if len(kept) >= max_nodes:
            break
        if d < max_depth and (p < 0 or p in kept):
            kept.add(i)
    keep = sorted(kept)
    return [tokens[i] for i in keep], select(keep, parents), [probs[i] for i in keep if i < len(probs)]


def match(tokens: Sequence[int], parents: Sequence[int], sequence: Sequence[int]) -> list[int]:
    """The longest root-down path whose tokens are a prefix of `sequence` (the first matching child at
    each level, as the greedy verifier walks): node indices."""
    children: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault((p, t), i)
    path, node = [], -1
    for t in sequence:
        node = children.get((node, t), -1)
        if node < 0:
            break
        path.append(node)
    return path
