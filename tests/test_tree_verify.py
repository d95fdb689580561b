"""Exact unit tests of the three token-tree verifiers (specdec/math/tree_verify.py); the trees' validation
and layout: tests/test_tree.py.

Per session the target gives p [N + 1, V] (row 0 after the root, row 1 + i after node i), q [N, V] the
draft row node i was drawn from. The hand-built cases make every accept / reject certain
(r(c) >= q_k(c) > 0 accepts, r(c) = 0 or q_k(c) = 0 rejects) and every drawn distribution one-hot, so
(path, next token) is exact; each is checked over many seeds, per session and batched. Then the batched
verifiers are pinned to the per-session references on random ragged batches, and a chain through the
tree functions to today's chain functions (rejection.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.math.rejection import (rejection_sample, rejection_sample_batched, round_randomness, verify_greedy,
                                    verify_greedy_batched)
from specdec.math.draw import draw
from specdec.math.sampling import make_generator
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.math.tree import chain_parents
from specdec.math.tree_verify import (level_uniforms, num_levels, tree_candidates_sample, tree_greedy,
                                      tree_rejection_sample, verify_tree_candidates_batched, verify_tree_greedy_batched,
                                      verify_tree_sampled_batched)
from tests.math_cases import cu_of, d, random_tree, t
from tests.test_batched_verify import ragged_case

SEEDS = range(48)


def batched_sampled(sessions, seeds, without_replacement=False):
    """verify_tree_sampled_batched over sessions [(p, q, tokens, parents)] with round_randomness."""
    sizes = [s[2].shape[0] for s in sessions]
    v = sessions[0][0].shape[1]
    uniform, at = round_randomness([make_generator(s) for s in seeds], sizes)
    wor = torch.as_tensor(without_replacement).expand(len(sessions))
    q = torch.cat([s[1] for s in sessions]) if sum(sizes) else torch.zeros(0, v)
    return verify_tree_sampled_batched(torch.cat([s[0] for s in sessions]), q, torch.cat([s[2] for s in sessions]),
                                       torch.cat([s[3] for s in sessions]), cu_of(sizes), uniform, at, wor)


def assert_sampled(p, q, tokens, parents, expected: tuple[list[int], int], schemes=(False, True)) -> None:
    """Exact (path, next token) for every seed, per session and batched (three copies in one batch)."""
    for wor in schemes:
        for seed in SEEDS:
            got = tree_rejection_sample(p, q, tokens, parents, make_generator(seed), without_replacement=wor)
            assert got == expected, (wor, seed)
        verdict = batched_sampled([(p, q, tokens, parents)] * 3, [1, 2, 3], wor)
        for b in range(3):
            assert ([i for i in verdict.path[b].tolist() if i >= 0], int(verdict.next_token[b])) == expected
            assert int(verdict.num_accepted[b]) == len(expected[0])


# --- Greedy ------------------------------------------------------------------------------------------


# The hand-built tree of test_tree.py's test_layout_of_a_hand_built_tree, with tokens; V = 5.
HAND_PARENTS = d([-1, -1, 0, 0, 1, 2])
HAND_TOKENS = d([1, 2, 3, 0, 4, 2])


def greedy_rows(argmax: list[int], v: int = 5) -> torch.Tensor:
    """[N + 1, V] logits whose argmax per row is given (a tie on the next token, to pin first-index)."""
    logits = torch.zeros(len(argmax), v)
    for i, a in enumerate(argmax):
        logits[i, a] = 2.0
        logits[i, (a + 1) % v] = 1.0
    return logits


@pytest.mark.parametrize("argmax, expected", [
    ([1, 3, 9, 2, 9, 9, 4], ([0, 2, 5], 4)),  # root -> 0 -> 2 -> 5 (leaf): bonus argmax after node 5
    ([2, 9, 4, 9, 9, 0, 9], ([1, 4], 0)),  # root -> 1 -> 4 (leaf): bonus
    ([3, 9, 9, 9, 9, 9, 9], ([], 3)),  # reject at the root: no child has token 3
    ([1, 4, 9, 9, 9, 9, 9], ([0], 4)),  # accept 0, none of its children (3, 0) is 4: correction 4
    ([1, 0, 9, 9, 9, 9, 9], ([0, 3], 9)),  # accept 0, then its second child 3 (token 0), a leaf
])
def test_greedy_walks_the_target_argmax(argmax, expected):
    v = 10
    logits = greedy_rows(argmax, v)
    assert tree_greedy(logits, HAND_TOKENS, HAND_PARENTS) == expected
    verdict = verify_tree_greedy_batched(torch.cat([logits] * 2), torch.cat([HAND_TOKENS] * 2),
                                         torch.cat([HAND_PARENTS] * 2), cu_of([6, 6]))
    for b in range(2):
        assert ([i for i in verdict.path[b].tolist() if i >= 0], int(verdict.next_token[b])) == expected


def test_greedy_duplicate_siblings_take_the_first():
    parents, tokens = d([-1, -1, 1]), d([3, 3, 2])  # node 1 duplicates node 0; only node 1 has a child
    logits = greedy_rows([3, 4, 2, 0])
    assert tree_greedy(logits, tokens, parents) == ([0], 4)
    verdict = verify_tree_greedy_batched(logits, tokens, parents, cu_of([3]))
    assert verdict.path.tolist() == [[0, -1]] and int(verdict.next_token[0]) == 4


@pytest.mark.parametrize("seed", range(20))
def test_greedy_batched_equals_reference_and_chains_equal_verify_greedy(seed):
    g = torch.Generator().manual_seed(seed)
    v = 6
    sizes = torch.randint(0, 8, (6,), generator=g).tolist()
    trees = [random_tree(g, n, v) for n in sizes]
    logits = [torch.randn(n + 1, v, generator=g) for n in sizes]
    verdict = verify_tree_greedy_batched(torch.cat(logits), torch.cat([x for _, x in trees]),
                                         torch.cat([p for p, _ in trees]), cu_of(sizes))
    for b, ((par, tok), lg) in enumerate(zip(trees, logits)):
        path, nxt = tree_greedy(lg, tok, par)
        assert ([i for i in verdict.path[b].tolist() if i >= 0], int(verdict.next_token[b])) == (path, nxt)
        # The same rows as a chain: the tree functions agree with verify_greedy / verify_greedy_batched.
        drafts = lg[:-1].argmax(-1)
        drafts[int(torch.randint(0, len(drafts) + 1, (1,), generator=g)) :] += 1
        drafts %= v
        chain = tree_greedy(lg, drafts, chain_parents(len(drafts)))
        assert (len(chain[0]), chain[1]) == verify_greedy(lg, drafts)
        assert chain[0] == list(range(len(chain[0])))
        n, nxt = verify_greedy_batched(lg, [drafts.tolist()])
        tree_chain = verify_tree_greedy_batched(lg, drafts, chain_parents(len(drafts)), cu_of([len(drafts)]))
        assert (int(tree_chain.num_accepted[0]), int(tree_chain.next_token[0])) == (n[0], nxt[0])


# --- Sampled trees with q: exact cases ---------------------------------------------------------------


def test_sampled_accepts_a_path_and_draws_the_bonus_at_the_leaf():
    # root children 0 (token 1), 1 (token 2); node 0's child 2 (token 3). V = 5.
    parents, tokens = d([-1, -1, 0]), d([1, 2, 3])
    q_root = [0.2, 0.4, 0.2, 0.1, 0.1]
    q = t([q_root, q_root, [0.3, 0.1, 0.2, 0.3, 0.1]])  # [N, V]
    p = t([
        [0.1, 0.7, 0.1, 0.1, 0.0],  # root: p(1) = 0.7 >= q(1) = 0.4, accept node 0
        [0.0, 0.0, 0.2, 0.8, 0.0],  # after node 0: p(3) = 0.8 >= 0.3, accept node 2
        [1.0, 0.0, 0.0, 0.0, 0.0],  # after node 1: never reached
        [0.0, 0.0, 0.0, 0.0, 1.0],  # after node 2 (a leaf): bonus one-hot on 4
    ])
    assert_sampled(p, q, tokens, parents, ([0, 2], 4))


def test_sampled_all_siblings_rejected_recovers_from_the_final_residual():
    # Both root children (tokens 1, 2) have p = 0. After node 0: r = max(0, p - q) = [0, 0, 0, 0.5, 0];
    # after node 1 still one-hot on 3. p itself would give 0 half the time.
    parents, tokens = d([-1, -1, 1]), d([1, 2, 0])
    q_root = [0.5, 0.25, 0.25, 0.0, 0.0]
    q = t([q_root, q_root, [1.0, 0.0, 0.0, 0.0, 0.0]])
    p = t([[0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert_sampled(p, q, tokens, parents, ([], 3))


def test_sampled_second_sibling_accepted_against_the_residual():
    # Node 0 (token 0, p = 0) is rejected; r = max(0, p - q) = [0, 0, 0.6, 0, 0], so node 1 (token 2) is
    # accepted with probability 1 (i.i.d.: min(1, 1 / 0.2); without replacement q_2 = [0, .6, .4, 0, 0]:
    # min(1, 1 / 0.4)). Node 1 is a leaf: bonus one-hot on 4.
    parents, tokens = d([-1, -1]), d([0, 2])
    q_root = [0.5, 0.3, 0.2, 0.0, 0.0]
    q = t([q_root, q_root])
    p = t([[0.0, 0.2, 0.8, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert_sampled(p, q, tokens, parents, ([1], 4))


def test_sampled_rejected_mid_path_recovers_from_that_nodes_residual():
    # Root child 0 (token 0) accepted (p = 0.6 > q = 0.5). Its children: node 1 (token 2, p = 0) is
    # rejected, leaving r = max(0, p - q) = [0, 0, 0, 0, 0, 0.4]; node 2 (token 3) then has r = 0 and is
    # rejected; recovered one-hot on 5. The rows of the root, of node 1 and of node 2 would all give
    # something else.
    parents, tokens = d([-1, 0, 0]), d([0, 2, 3])
    q_mid = [0.0, 0.3, 0.4, 0.3, 0.0, 0.0]
    q = t([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], q_mid, q_mid])
    p = t([
        [0.6, 0.0, 0.0, 0.0, 0.0, 0.4],
        [0.0, 0.3, 0.0, 0.3, 0.0, 0.4],  # after node 0: p - q = [0, 0, -0.4, 0, 0, 0.4]
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    assert_sampled(p, q, tokens, parents, ([0], 5))


def test_sampled_q_zero_rejects_even_where_p_is_positive():
    # Token 2 has q = 0 < p = 0.5: the draft could not have drawn it; rejected. The residual is one-hot
    # on 2 itself, so the result is ([], 2), not the bonus of node 0's row.
    parents, tokens = d([-1]), d([2])
    q = t([[0.5, 0.5, 0.0, 0.0, 0.0]])
    p = t([[0.3, 0.2, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert_sampled(p, q, tokens, parents, ([], 2))


def test_sampled_zero_residual_keeps_r_and_the_next_sibling_is_tried_against_it():
    # p == q, one-hot on 3. Node 0 (token 1, q = 0) is rejected and max(0, p - q) = 0: r stays p, and
    # node 1 (token 3) is accepted; its row gives the bonus 0. With node 0 alone: recovered from p, 3.
    q = t([[0.0, 0.0, 0.0, 1.0, 0.0]] * 2)
    p = t([[0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert_sampled(p, q, d([1, 3]), d([-1, -1]), ([1], 0), schemes=(False,))
    assert_sampled(p[:2], q[:1], d([1]), d([-1]), ([], 3))


def test_sampled_duplicate_siblings():
    # i.i.d. siblings may repeat: node 0 (token 0, p = 0) is rejected, so r(0) = 0 and its duplicate node 1
    # is rejected too; the recovered token is drawn from max(0, p - q) then max(0, r - q): one-hot on 2.
    # Without replacement a duplicate has q_k(0) = 0 and is rejected by that rule, same result.
    parents, tokens = d([-1, -1]), d([0, 0])
    q_root = [0.8, 0.2, 0.0, 0.0]
    q = t([q_root, q_root])
    p = t([[0.0, 0.1, 0.9, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    assert_sampled(p, q, tokens, parents, ([], 2))


def test_sampled_acceptance_probability_is_min_of_r_over_q_k():
    # One root child, token 0: p(0) / q(0) = 0.2 / 0.8 = 0.25. Accept -> bonus one-hot on 1; reject ->
    # max(0, p - q) one-hot on 2. The batched verifier reports 0.25, and the frequency matches it.
    q = t([[0.8, 0.1, 0.1]])
    p = t([[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])
    n = 3000
    results = [tree_rejection_sample(p, q, d([0]), d([-1]), make_generator(s)) for s in range(n)]
    assert set(map(lambda r: (tuple(r[0]), r[1]), results)) == {((0,), 1), ((), 2)}
    rate = sum(1 for r in results if r[0]) / n
    assert abs(rate - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n), rate
    verdict = batched_sampled([(p, q, d([0]), d([-1]))], [0])
    assert float(verdict.accept_prob[0]) == pytest.approx(0.25)


# --- Sampled trees: batched equals reference; chains equal rejection_sample ---------------------------


def random_sampled_session(g: torch.Generator, n: int, v: int, distinct: bool):
    """(p [N+1, V], q [N, V], tokens, parents) with p's zeros (top-k-like), q rows that are softmaxes,
    one-hot, equal to p at the parent (zero residuals), or zero on the node's token."""
    parents, tokens = random_tree(g, n, v, distinct)
    logits = torch.randn(n + 1, v, generator=g) * 2
    logits[torch.rand(n + 1, v, generator=g) < 0.3] = -math.inf
    logits[:, 0] = logits[:, 0].clamp(min=0)  # at least one token per row
    p = logits.softmax(-1)
    q = torch.randn(n, v, generator=g).softmax(-1)
    for i in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        if kind == 1:
            q[i] = torch.nn.functional.one_hot(tokens[i], v).float()
        elif kind == 2:
            q[i] = p[int(parents[i]) + 1]
        elif kind == 3:
            q[i, tokens[i]] = 0
            q[i] /= q[i].sum()
    # Siblings drawn without replacement share their parent's row: copy the first sibling's row.
    if distinct:
        for i in range(n):
            first = next(j for j in range(n) if parents[j] == parents[i])
            q[i] = q[first]
    return p, q, tokens, parents


@pytest.mark.parametrize("seed", range(30))
def test_sampled_batched_equals_reference_per_session(seed):
    g = torch.Generator().manual_seed(100 + seed)
    v = 12
    sizes = torch.randint(0, 9, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
    wor = [bool(torch.randint(0, 2, (1,), generator=g)) for _ in sizes]
    sessions = [random_sampled_session(g, n, v, w) for n, w in zip(sizes, wor)]
    seeds = [seed * 100 + b for b in range(len(sizes))]
    verdict = batched_sampled(sessions, seeds, torch.tensor(wor))
    for b, (p, q, tokens, parents) in enumerate(sessions):
        path, nxt = tree_rejection_sample(p, q, tokens, parents, make_generator(seeds[b]), without_replacement=wor[b])
        assert ([i for i in verdict.path[b].tolist() if i >= 0], int(verdict.next_token[b])) == (path, nxt), b
        assert int(verdict.num_accepted[b]) == len(path)
    # The outcome of a session does not depend on the rest of the batch.
    for b in range(len(sizes)):
        alone = batched_sampled([sessions[b]], [seeds[b]], torch.tensor([wor[b]]))
        assert torch.equal(alone.path[0][: verdict.path.shape[1]], verdict.path[b][: alone.path.shape[1]])
        assert int(alone.next_token[0]) == int(verdict.next_token[b])


KINDS = ["one_hot", "truncated", "q_equals_p", "q_zero"]


@pytest.mark.parametrize("seed", range(30))
def test_chain_through_the_tree_verifier_equals_rejection_sample(seed):
    """A chain (parents -1, 0, 1, ...) through the tree functions consumes the same draws as today's chain
    functions (N uniforms, then one draw) and gives the same result, per session and batched."""
    g = torch.Generator().manual_seed(2000 + seed)
    b = int(torch.randint(1, 8, (1,), generator=g))
    ks = torch.randint(0, 6, (b,), generator=g).tolist()
    kinds = [KINDS[int(i)] for i in torch.randint(0, len(KINDS), (b,), generator=g)]
    sessions = ragged_case(seed, ks, kinds)
    seeds = [seed * 100 + i for i in range(b)]
    cu = cu_of(ks)
    uniform, at = round_randomness([make_generator(s) for s in seeds], ks)
    flat = [torch.cat([s[i] for s in sessions]) if sum(ks) or i == 0 else torch.zeros(0, 50) for i in range(2)]
    drafts = torch.cat([s[2] for s in sessions])
    n, nxt = rejection_sample_batched(flat[0], flat[1], drafts, cu, uniform, at)
    parents = torch.cat([chain_parents(k) for k in ks])
    for wor in (False, True):
        verdict = verify_tree_sampled_batched(flat[0], flat[1], drafts, parents, cu, uniform, at, wor)
        assert torch.equal(verdict.num_accepted, n) and torch.equal(verdict.next_token, nxt)
    for i, (p, q, dr) in enumerate(sessions):
        reference = rejection_sample(p, q, dr, make_generator(seeds[i]))
        path, token = tree_rejection_sample(p, q, dr, chain_parents(len(dr)), make_generator(seeds[i]))
        assert (len(path), token) == reference and path == list(range(len(path)))


# --- Deterministic candidates ------------------------------------------------------------------------


def position_generators(seed: int, committed_len: int, levels: int) -> list[torch.Generator]:
    return [make_generator(derive_seed(seed, committed_len + lv, TARGET_STREAM)) for lv in range(levels)]


def test_candidates_exact_cases_with_one_hot_p():
    # p one-hot at every row: the draw is certain. Same tree and rows as the greedy cases.
    for argmax, expected in [([1, 3, 9, 2, 9, 9, 4], ([0, 2, 5], 4)), ([3, 9, 9, 9, 9, 9, 9], ([], 3)),
                             ([1, 4, 9, 9, 9, 9, 9], ([0], 4))]:
        p = torch.nn.functional.one_hot(d(argmax), 10).float()
        for seed in range(16):
            gens = position_generators(seed, 7, num_levels(HAND_PARENTS, cu_of([6]))[0])
            assert tree_candidates_sample(p, HAND_TOKENS, HAND_PARENTS, gens) == expected
        at = level_uniforms([position_generators(3, 7, 4)])
        verdict = verify_tree_candidates_batched(p, HAND_TOKENS, HAND_PARENTS, cu_of([6]), at)
        assert ([i for i in verdict.path[0].tolist() if i >= 0], int(verdict.next_token[0])) == expected


@pytest.mark.parametrize("seed", range(20))
def test_candidates_batched_equals_reference_per_session(seed):
    g = torch.Generator().manual_seed(300 + seed)
    v = 6
    sizes = torch.randint(0, 8, (5,), generator=g).tolist()
    trees = [random_tree(g, n, v) for n in sizes]
    parents, tokens, cu = torch.cat([p for p, _ in trees]), torch.cat([x for _, x in trees]), cu_of(sizes)
    p = (torch.randn(sum(sizes) + len(sizes), v, generator=g)).softmax(-1)
    levels = num_levels(parents, cu)
    at = level_uniforms([position_generators(seed * 10 + b, 20, lv) for b, lv in enumerate(levels)])
    verdict = verify_tree_candidates_batched(p, tokens, parents, cu, at)
    for b, (par, tok) in enumerate(trees):
        rows = p[int(cu[b]) + b : int(cu[b + 1]) + b + 1]
        expected = tree_candidates_sample(rows, tok, par, position_generators(seed * 10 + b, 20, levels[b]))
        assert ([i for i in verdict.path[b].tolist() if i >= 0], int(verdict.next_token[b])) == expected


@pytest.mark.parametrize("seed", range(8))
def test_candidates_output_does_not_depend_on_the_proposal(seed):
    """Proposal-invariant: a whole generation (bigram target, position-keyed draws) is token for token the
    target-alone sample with the same draws, whatever trees are proposed each round (random shapes and
    tokens, empty trees, the target's own likely continuations)."""
    g = torch.Generator().manual_seed(seed)
    v, length = 6, 24
    P = (torch.randn(v, v, generator=g) * 2).softmax(-1)
    alone, prev = [], 0
    for pos in range(length):
        prev = draw(P[prev], position_generators(seed, pos, 1)[0])
        alone.append(prev)
    for proposer in range(3):
        out, prev = [], 0
        while len(out) < length:
            n = int(torch.randint(0, 9, (1,), generator=g))
            parents, tokens = random_tree(g, n, v)
            if proposer == 1:
                parents, tokens = d([]), d([])
            elif proposer == 2 and n:  # a chain of the target's argmax continuation plus random branches
                tokens[0] = int(P[prev].argmax())
            cu = cu_of([len(tokens)])
            rows = torch.cat([d([prev]), tokens])
            at = level_uniforms([position_generators(seed, len(out), num_levels(parents, cu)[0])])
            verdict = verify_tree_candidates_batched(P[rows], tokens, parents, cu, at)
            out += [int(tokens[i]) for i in verdict.path[0].tolist() if i >= 0] + [int(verdict.next_token[0])]
            prev = out[-1]
        assert out[:length] == alone, proposer
