"""Model-free token trees in the coordinator: the tree helpers, prompt lookup offering several matches as
sibling branches, and suffix decoding expanding its match best-first into a speculation tree."""

from __future__ import annotations

from array import array

from coordinator.proposers.lookup import LookupConfig, LookupStrategy
from coordinator.proposers.ngram_index import NgramIndex
from coordinator.proposers.suffix import SuffixStrategy
from coordinator.proposers.suffix_tree import SuffixConfig, SuffixTree, speculate
from coordinator.proposers.token_tree import TreeBuilder, cut, depths, match
from tests.proposer_fakes import started


def test_tree_builder_merges_shared_prefixes_within_the_budget():
    tree = TreeBuilder(5)
    tree.add_branch([1, 2, 3])
    tree.add_branch([1, 2, 4])  # shares 1, 2: one new node
    tree.add_branch([5, 6, 7])  # only one node left
    assert (tree.tokens, tree.parents) == ([1, 2, 3, 4, 5], [-1, 0, 1, 1, -1])
    assert tree.full


def test_cut_match_and_depths():
    tokens, parents = [1, 2, 3, 4, 5, 6], [-1, 0, 1, 1, -1, 4]
    assert depths(parents) == [0, 1, 2, 2, 0, 1]
    assert cut(tokens, parents, [0.9, 0.8, 0.5, 0.4, 0.3, 0.2], 2, 10) == ([1, 2, 5, 6], [-1, 0, -1, 2], [0.9, 0.8, 0.3, 0.2])
    assert cut(tokens, parents, [], 5, 3) == ([1, 2, 3], [-1, 0, 1], [])
    assert match(tokens, parents, [1, 2, 4, 9]) == [0, 1, 3]
    assert match(tokens, parents, [5, 6, 1]) == [4, 5]
    assert match(tokens, parents, [7]) == []


def test_lookup_offers_every_recent_match_as_a_branch():
    # "1 2" occurs three times, continued by 3 4, 5 6 and 3 7; the latest (3 7) is the chain
    seq = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 1, 2]
    index = NgramIndex(LookupConfig(min_ngram=2, max_ngram=3), seq)
    assert index.propose(2) == [3, 7]
    tokens, parents = index.propose_tree(2, 16)
    assert (tokens, parents) == ([3, 7, 5, 6, 4], [-1, 0, -1, 2, 0])
    assert index.propose_tree(2, 3) == ([3, 7, 5], [-1, 0, -1])
    p = started(LookupStrategy(LookupConfig(2, 3), seq)).offer(2, tree_nodes=4)
    assert (p.tokens, p.parents) == ([3, 7, 5, 6], [-1, 0, -1, 2])
    assert started(LookupStrategy(LookupConfig(2, 3), seq)).offer(2).parents == []


def test_suffix_tree_expands_best_first_with_the_chain_first():
    tree = SuffixTree(8)
    # after "1 2": 3 three times, 4 once; after "1 2 3": 5 twice, 6 once
    tree.extend(0, [1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0, 1, 2, 4, 0, 1, 2])
    config = SuffixConfig(max_depth=8, max_spec_factor=2.0, min_token_prob=0.1)
    chain = speculate(tree, tree.seqs[0], 4, config, seq_id=0)
    tokens, parents, probs = SuffixTree.expand(*chain.spot, 6, chain.limit, config.min_token_prob)
    assert tokens[: len(chain.tokens)] == chain.tokens[: len(tokens)]
    assert all(a >= b for a, b in zip(probs, probs[1:])), probs
    assert set(zip(tokens, parents)) >= {(3, -1), (4, -1)}, (tokens, parents)  # the two branches after "1 2"
    three = tokens.index(3)
    assert {tokens[i] for i, p in enumerate(parents) if p == three} == {5, 6}
    assert abs(probs[tokens.index(4)] - 0.25) < 1e-9 and abs(probs[three] - 0.75) < 1e-9
    proposer = SuffixStrategy(SuffixConfig(max_depth=8, max_spec_factor=2.0, cache_entries=0), None)
    proposer.commit(list(tree.seqs[0]))
    p = proposer.offer(4, tree_nodes=6)
    assert (p.tokens, p.parents) == (tokens, parents) and p.probs == probs
