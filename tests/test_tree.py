"""Exact unit tests of token trees (specdec/math/tree.py): validation, naming the field of a malformed
tree, and the attention layout (depths, positions, ancestor masks, sibling links), by hand-built cases
and against a brute force on random ragged batches. The verifiers over these trees are tested in
tests/test_tree_verify.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.math.tree import (ancestor_mask, chain_parents, sibling_links, tree_depth, tree_positions,
                               validate_tree)
from specdec.math.tree_verify import num_levels
from tests.math_cases import cu_of, d, random_tree, t


# --- Validation --------------------------------------------------------------------------------------


GOOD = dict(parents=d([-1, -1, 0, 0, 2]), tokens=d([1, 2, 3, 4, 1]), cu=cu_of([5]))


@pytest.mark.parametrize("parents, tokens, cu, kwargs, field", [
    pytest.param([-1, 5, 0], [1, 2, 3], [0, 3], {}, r"parents: session 0 node 1 has parent 5, out of range", id="parent-too-large"),
    pytest.param([-1, -2, 0], [1, 2, 3], [0, 3], {}, r"parents: session 0 node 1 has parent -2", id="parent-below-root"),
    pytest.param([-1, 2, 0], [1, 2, 3], [0, 3], {}, r"parents: session 0 node 1 has parent 2; a parent must come before", id="not-topological"),
    pytest.param([-1, 1, 0], [1, 2, 3], [0, 3], {}, r"parents: session 0 has a cycle through node 1", id="self-parent"),
    pytest.param([-1, 2, 1], [1, 2, 3], [0, 3], {}, r"parents: session 0 has a cycle through node", id="cycle"),
    pytest.param([-1, 0, -1, 0], [1, 2, 3, 4], [0, 2, 4], {}, None, id="valid-two-sessions"),
    pytest.param([-1, 0, -1, 1], [1, 2, 3, 4], [0, 2, 4], {}, r"parents: session 1 has a cycle through node 1", id="cycle-in-second-session"),
    pytest.param([-1, 0, -1, 3], [1, 2, 3, 4], [0, 2, 4], {}, r"parents: session 1 node 1 has parent 3, out of range \[-1, 2\)", id="parent-in-other-session"),
    pytest.param([-1] * 5, [0, 1, 2, 3, 4], [0, 5], {"max_nodes": 4}, r"tokens: session 0 has 5 nodes, more than max_nodes = 4", id="too-many-nodes"),
    pytest.param([-1, -1], [1, 9], [0, 2], {}, r"tokens: session 0 node 1 has token 9, outside the vocabulary", id="token-outside-vocab"),
    pytest.param([-1, -1, 0, 0], [1, 2, 3, 3], [0, 4], {"distinct_siblings": True}, r"tokens: session 0 nodes 2 and 3 are siblings with the same token 3", id="duplicate-siblings"),
    pytest.param([-1, 0], [1, 2], [0, 3], {}, r"cu_num_nodes must rise from 0 to 2", id="cu-mismatch"),
    pytest.param([-1, 0], [1], [0, 2], {}, r"parents and tokens must be 1-D of one length", id="length-mismatch"),
])
def test_validate_rejects_malformed_trees_naming_the_field(parents, tokens, cu, kwargs, field):
    args = dict(vocab_size=kwargs.pop("vocab_size", 8), max_nodes=kwargs.pop("max_nodes", 16), **kwargs)
    if field is None:
        validate_tree(d(parents), d(tokens), d(cu), **args)
        return
    with pytest.raises(ValueError, match=field):
        validate_tree(d(parents), d(tokens), d(cu), **args)


def test_validate_allows_duplicate_siblings_unless_required_and_checks_q():
    parents, tokens, cu = d([-1, -1]), d([3, 3]), cu_of([2])
    validate_tree(parents, tokens, cu, vocab_size=5, max_nodes=4)  # i.i.d. siblings may repeat
    validate_tree(parents, tokens, cu, vocab_size=5, max_nodes=4, q=torch.full((2, 5), 0.2))
    for q, field in [(torch.full((2, 4), 0.25), r"q must be \[2, 5\]"),
                     (t([[0.2] * 5, [0.5, 0.5, 0.1, 0.0, -0.1]]), r"q: session 0 node 1 has a negative"),
                     (t([[0.2] * 5, [math.nan] * 5]), r"q: session 0 node 1 has a negative or non-finite"),
                     (t([[0.2] * 5, [0.5] * 5]), r"q: session 0 node 1 sums to 2.5, not 1")]:
        with pytest.raises(ValueError, match=field):
            validate_tree(parents, tokens, cu, vocab_size=5, max_nodes=4, q=q)
    validate_tree(d([]), d([]), cu_of([0, 0]), vocab_size=5, max_nodes=4)  # sessions with no nodes


# --- Layout ------------------------------------------------------------------------------------------


def test_layout_of_a_hand_built_tree():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    #    |
    #    5
    parents = d([-1, -1, 0, 0, 1, 2])
    cu = cu_of([6])
    assert tree_depth(parents, cu).tolist() == [0, 0, 1, 1, 1, 2]
    assert tree_positions(tree_depth(parents, cu), cu, d([10])).tolist() == [10, 10, 11, 11, 11, 12]
    mask = ancestor_mask(parents, cu).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    slot, first_child, next_sibling = sibling_links(parents, cu)
    assert slot.tolist() == [6, 6, 0, 0, 1, 2]
    assert first_child.tolist() == [2, 4, 5, -1, -1, -1, 0]  # nodes 0..5, then the root
    assert next_sibling.tolist() == [1, -1, 3, -1, -1, -1]
    assert num_levels(parents, cu) == [4]


def test_chain_layout_is_lower_triangular_with_consecutive_positions():
    cu = cu_of([4, 0, 3])
    parents = torch.cat([chain_parents(4), chain_parents(0), chain_parents(3)])
    mask = ancestor_mask(parents, cu)
    expected = torch.block_diag(torch.ones(4, 4).tril(), torch.ones(3, 3).tril()).bool()
    assert torch.equal(mask, expected)
    assert tree_positions(tree_depth(parents, cu), cu, d([5, 9, 2])).tolist() == [5, 6, 7, 8, 2, 3, 4]
    assert num_levels(parents, cu) == [5, 1, 4]


@pytest.mark.parametrize("seed", range(10))
def test_layout_matches_brute_force_on_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 9, (5,), generator=g).tolist()
    trees = [random_tree(g, n, 7) for n in sizes]
    parents, cu = torch.cat([p for p, _ in trees]), cu_of(sizes)
    validate_tree(parents, torch.cat([x for _, x in trees]), cu, vocab_size=7, max_nodes=8)
    depth, mask = tree_depth(parents, cu), ancestor_mask(parents, cu)
    expected = torch.zeros(sum(sizes), sum(sizes), dtype=torch.bool)
    for b, (par, _) in enumerate(trees):
        start = int(cu[b])
        for i in range(len(par)):
            j, depth_i = i, -1
            while j >= 0:  # i itself, then its ancestors
                expected[start + i, start + j] = True
                j, depth_i = int(par[j]), depth_i + 1
            assert int(depth[start + i]) == depth_i
    assert torch.equal(mask, expected)
