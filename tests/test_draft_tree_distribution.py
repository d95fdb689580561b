"""Trees grown as the draft engine grows them (specdec.engine.tree_growth.Growth: siblings drawn i.i.d. or
without replacement from q with position- and node-keyed draws, the likeliest nodes of a level expanded within
the node budget) (CANDIDATES trees dynamic: grown past the budget, the likeliest N kept) and verified by the target's engine (specdec.engine.verify) keep the target's distribution
exactly: the first N_TOKENS tokens generated round after round match the exact target joint (chi-square and
total variation, test_distribution's harness), for each scheme and for a batch that mixes them with chains.
Synthetic bigram tables stand in for the models (q at a node: the draft table's row of the node's token)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdec.engine.tree_growth import Growth, TreeShape
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT, VerifyWork, _verify_sampled, _verify_trees
from specdec.math.params import SamplingParams
from specdec.math.seeds import mix64
from tests.test_distribution import N_TOKENS, START, V, assert_matches_target, exact_joint, make_tables

pytestmark = pytest.mark.slow

N_TRIALS = 5_000
PARAMS = SamplingParams(temperature=1.0)
SHAPE = dict(nodes=7, depth=3, branching=2)  # levels of 2, 4 and 1 node: the third expands the likeliest second-level node


def dist(Q: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(Q[token], descending=True)  # most likely first, as the engine's top-n
    return order, Q[token][order]


def grow(scheme: str, prev: int, Q: torch.Tensor, seed: int, position: int) -> Growth:
    """The draft engine's growth of one tree below `prev` (the last committed token)."""
    g = Growth(TreeShape(scheme=scheme, **SHAPE), -1, position, dynamic=scheme == CANDIDATES)
    level = g.expand(-1, dist(Q, prev), seed, greedy_logits=False)
    while True:
        nodes = g.to_expand(level)
        if not nodes:
            g.keep_best()  # a dynamic (CANDIDATES) tree: the N likeliest of its candidates
            return g
        level = [c for n in nodes for c in g.expand(n, dist(Q, g.tokens[n]), seed, greedy_logits=False)]


def run(schemes: list[str], P: torch.Tensor, Q: torch.Tensor, n_trials: int, seed: int) -> np.ndarray:
    """Trial t proposes with schemes[t % len]; "chain" is a K = 2 chain from q (rejection sampling)."""
    logP = P.clamp_min(1e-30).log()
    outs: list[list[int]] = [[] for _ in range(n_trials)]
    rnd = 0
    while True:
        live = [t for t in range(n_trials) if len(outs[t]) < N_TOKENS]
        if not live:
            break
        trees, chains = [], []
        for t in live:
            prev = outs[t][-1] if outs[t] else START
            scheme = schemes[t % len(schemes)]
            draft_seed, verify_seed = mix64(seed * 7919 + t), mix64(seed * 1_000_003 + t * 101 + rnd)
            if scheme == "chain":
                g = grow_chain(prev, Q, draft_seed, len(outs[t]))
                q = DraftProbs.from_rows([(ids, p) for ids, p in g.rows])
                chains.append((t, VerifyWork.create("c", 0, 0, [prev], g.tokens, q, PARAMS, verify_seed),
                               logP[[prev] + g.tokens]))
                continue
            g = grow(scheme, prev, Q, draft_seed, len(outs[t]))
            q = DraftProbs.from_rows(g.rows) if scheme != CANDIDATES else None
            work = VerifyWork.create("s", 0, 0, [prev], g.tokens, q, PARAMS, verify_seed, parents=g.parents, scheme=scheme)
            trees.append((t, work, logP[[prev] + g.tokens]))
        if trees:
            for (t, w, _), (path, nxt) in zip(trees, _verify_trees([w for _, w, _ in trees], [lg for _, _, lg in trees], V)):
                outs[t].extend([w.drafts[i] for i in path] + [nxt])
        if chains:
            n, nxt = _verify_sampled([w for _, w, _ in chains], [lg for _, _, lg in chains], V)
            for (t, w, _), k, x in zip(chains, n, nxt):
                outs[t].extend(w.drafts[:k] + [x])
        rnd += 1
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for out in outs:
        counts[tuple(out[:N_TOKENS])] += 1
    return counts


def grow_chain(prev: int, Q: torch.Tensor, seed: int, position: int) -> Growth:
    g = Growth(TreeShape(2, 2, 1, IID), -1, position)
    level = g.expand(-1, dist(Q, prev), seed, greedy_logits=False)
    g.expand(level[0], dist(Q, g.tokens[level[0]]), seed, greedy_logits=False)
    return g


@pytest.mark.parametrize("schemes", [[IID], [WITHOUT_REPLACEMENT], [CANDIDATES], [IID, WITHOUT_REPLACEMENT, "chain"]])
def test_draft_trees_keep_the_target_distribution(schemes):
    P, Q = make_tables(PARAMS)
    assert_matches_target(run(schemes, P, Q, N_TRIALS, seed=21), exact_joint(P))


def test_the_growth_really_branches_and_expands_the_likeliest_node():
    _, Q = make_tables(PARAMS)
    g = grow(WITHOUT_REPLACEMENT, START, Q, seed=3, position=0)
    assert g.parents[:2] == [-1, -1] and len(g.tokens) == 7
    third = g.parents[6]
    second_level = [i for i, p in enumerate(g.parents) if p in (0, 1)]
    assert third == max(second_level, key=lambda i: g.prob[i])


def grow_greedy(shape: TreeShape, dist_of, dynamic: bool, prune: bool = True) -> Growth:
    """A greedy tree over synthetic distributions; prune=False expands every level's b likeliest nodes
    whatever their chance of being kept (the reference for the dynamic tree's pruning)."""
    g = Growth(shape, -1, 0, dynamic)
    level = g.expand(-1, dist_of(()), 0, greedy_logits=True)
    while True:
        if prune:
            nodes = g.to_expand(level)
        else:
            g.levels += 1
            nodes = [] if g.levels >= shape.depth else sorted(sorted(level, key=lambda i: -g.prob[i])[: shape.branching])
        if not nodes:
            g.keep_best()
            return g
        level = [c for n in nodes for c in g.expand(n, dist_of(g.path(n)), 0, greedy_logits=True)]


def synthetic(confidence: float, seed: int):
    """Each node's distribution over 8 tokens: its top token `confidence`, the rest a random split."""
    def dist_of(p: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(p) % 1_000_003)
        rest = torch.rand(7, generator=g)
        probs = torch.cat([torch.tensor([confidence]), (1 - confidence) * rest / rest.sum()])
        order = torch.argsort(probs, descending=True)
        return torch.randperm(8, generator=g)[order] + 10, probs[order]
    return dist_of


@pytest.mark.parametrize("confidence, seed", [(0.9, 1), (0.5, 2), (0.2, 3), (0.35, 4)])
def test_a_dynamic_tree_keeps_the_likeliest_paths_of_its_candidates(confidence, seed):
    """Greedy children are deterministic, so a tree may be grown past its budget and cut to the N paths the
    draft finds likeliest: the kept nodes are exactly the N best of every candidate the levels grew (pruning
    the expansion loses none of them), each kept node's ancestors are kept, and the shape follows the
    draft's confidence: a sure draft grows one deep path, an unsure one a wide, shallow tree."""
    shape = TreeShape(8, 5, 4, "greedy")
    dist_of = synthetic(confidence, seed)
    g = grow_greedy(shape, dist_of, dynamic=True)
    full = grow_greedy(shape, dist_of, dynamic=True, prune=False)
    assert len(g.tokens) == shape.nodes and len(full.tokens) == shape.nodes
    assert sorted(g.path(i) for i in range(8)) == sorted(full.path(i) for i in range(8))
    assert all(p < i for i, p in enumerate(g.parents))  # ancestors kept, parents first
    for i in range(8):  # each kept node's probability is its path's, through the renumbered parents
        p = g.path(i)
        expected = math.prod(float(dist_of(p[:d])[1][dist_of(p[:d])[0].tolist().index(t)]) for d, t in enumerate(p))
        assert g.prob[i] == pytest.approx(expected, rel=1e-6)
    depth = max(g.depth) + 1
    root_children = sum(p == -1 for p in g.parents)
    if confidence >= 0.9:
        assert depth == shape.depth and root_children < shape.branching  # one deep path, little beside it
    if confidence <= 0.2:
        assert depth <= 2 and root_children == shape.branching


def test_a_sampled_tree_keeps_every_drawn_node_within_its_budget():
    """IID and WITHOUT_REPLACEMENT trees are not dynamic: no drawn node may be dropped for what it drew."""
    _, Q = make_tables(PARAMS)
    for scheme in (IID, WITHOUT_REPLACEMENT):
        g = grow(scheme, START, Q, seed=5, position=0)
        assert not g.dynamic and len(g.tokens) == SHAPE["nodes"]
