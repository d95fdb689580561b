"""Exact unit tests of lossless rejection sampling (specdec/math/rejection.py: rejection_sample and its
greedy fast path) (in the style of vLLM's test_rejection_sampler.py).

Notation: p = target probabilities [K+1, V] (rows p_1..p_K at the draft positions, p_{K+1} the bonus
row), q = draft probabilities [K, V], d = draft tokens [K]. The cases are built so that every
accept/reject decision is certain (p_i(d_i) >= q_i(d_i) > 0 accepts, p_i(d_i) = 0 or q_i(d_i) = 0
rejects) and every drawn distribution is one-hot, so (n_accepted, next_token) is exact; each case is
checked over many generator seeds so that a wrong rule cannot pass by luck.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.math.draw import draw
from specdec.math.params import SamplingParams
from specdec.math.rejection import dense_q, rejection_sample
from specdec.math.sampling import make_generator, process_logits
from tests.math_cases import d, t

SEEDS = range(64)
GREEDY = SamplingParams(temperature=0.0)


def assert_result(p, q, draft_tokens, expected: tuple[int, int]) -> None:
    """rejection_sample gives exactly `expected` for every seed (and with no generator)."""
    for seed in SEEDS:
        assert rejection_sample(p, q, draft_tokens, make_generator(seed)) == expected, f"seed={seed}"
    assert rejection_sample(p, q, draft_tokens, None) == expected


# --- rejection_sample: exact cases ----------------------------------------------------------


def test_all_accepted_with_bonus():
    # K = 3, V = 5; p_i(d_i) > q_i(d_i) > 0 at every position, so each acceptance prob is 1.
    draft_tokens = d([1, 3, 0])
    q = t([  # [K, V]
        [0.2, 0.4, 0.2, 0.1, 0.1],  # q_1(1) = 0.4
        [0.3, 0.1, 0.2, 0.3, 0.1],  # q_2(3) = 0.3
        [0.1, 0.2, 0.3, 0.2, 0.2],  # q_3(0) = 0.1
    ])
    p = t([  # [K+1, V]
        [0.1, 0.7, 0.1, 0.1, 0.0],  # p_1(1) = 0.7
        [0.0, 0.0, 0.2, 0.8, 0.0],  # p_2(3) = 0.8
        [0.5, 0.1, 0.1, 0.1, 0.2],  # p_3(0) = 0.5
        [0.0, 0.0, 0.0, 0.0, 1.0],  # bonus p_4: one-hot on 4
    ])
    assert_result(p, q, draft_tokens, (3, 4))


def test_all_accepted_when_p_equals_q():
    # K = 2, V = 4; p_i == q_i: every draft is accepted whatever u is.
    draft_tokens = d([2, 1])
    q = t([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])  # [K, V]
    p = torch.cat([q, t([[0.0, 1.0, 0.0, 0.0]])])  # [K+1, V], bonus one-hot on 1
    assert_result(p, q, draft_tokens, (2, 1))


def test_first_draft_rejected_recovered_from_residual():
    # K = 2, V = 5; p_1(d_1) = 0 rejects d_1; max(0, p_1 - q_1) = [0, 0, 0.5, 0, 0] is one-hot on 2,
    # although p_1 itself would also give token 0 half the time.
    draft_tokens = d([1, 3])
    q = t([
        [0.5, 0.5, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0, 0.0],
    ])  # [K, V]
    p = t([
        [0.5, 0.0, 0.5, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
    ])  # [K+1, V]
    assert_result(p, q, draft_tokens, (0, 2))


def test_middle_draft_rejected_recovered_from_its_residual():
    # K = 3, V = 6; d_1 accepted (p_1(d_1) = 0.6 > q_1(d_1) = 0.5), d_2 rejected (p_2(d_2) = 0),
    # recovered token from max(0, p_2 - q_2), one-hot on 5. Rows 1, 3 and the bonus row would all
    # give something else, so a wrong row index is caught.
    draft_tokens = d([0, 2, 4])
    q = t([
        [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.3, 0.4, 0.3, 0.0, 0.0],  # q_2
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
    ])  # [K, V]
    p = t([
        [0.6, 0.0, 0.0, 0.0, 0.0, 0.4],
        [0.0, 0.3, 0.0, 0.3, 0.0, 0.4],  # p_2: p_2 - q_2 = [0, 0, -0.4, 0, 0, 0.4]
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])  # [K+1, V]
    assert_result(p, q, draft_tokens, (1, 5))


def test_stops_at_the_first_of_several_rejections():
    # K = 3, V = 5; d_1 accepted, d_2 and d_3 both certainly rejected (p_i(d_i) = 0). The round
    # stops at position 2: (1, recovered from row 2 = 3), not (2, recovered from row 3 = 4).
    draft_tokens = d([0, 1, 2])
    q = t([
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0, 0.0],
    ])  # [K, V]
    p = t([
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0, 0.0],  # max(0, p_2 - q_2) one-hot on 3
        [0.0, 0.0, 0.0, 0.0, 1.0],  # max(0, p_3 - q_3) one-hot on 4
        [1.0, 0.0, 0.0, 0.0, 0.0],
    ])  # [K+1, V]
    assert_result(p, q, draft_tokens, (1, 3))


def test_draft_outside_q_support_is_rejected_even_if_p_is_positive():
    # K = 1, V = 5; q_1(d_1) = 0 < p_1(d_1) = 0.5: the draft could not have proposed d_1, so it is
    # rejected (not accepted with ratio p/q = inf). The residual max(0, p_1 - q_1) is then one-hot on
    # d_1 itself, so the result is exactly (0, d_1) rather than (1, bonus=4).
    draft_tokens = d([2])
    q = t([[0.5, 0.5, 0.0, 0.0, 0.0]])  # [K, V]
    p = t([
        [0.3, 0.2, 0.5, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
    ])  # [K+1, V]
    assert_result(p, q, draft_tokens, (0, 2))


def test_zero_residual_falls_back_to_p():
    # K = 2, V = 5; d_1 accepted. At position 2, p_2 == q_2 (both one-hot on 3) and d_2 = 1 lies
    # outside both supports, so d_2 is rejected and max(0, p_2 - q_2) is all zeros: the recovered
    # token must come from p_2, i.e. 3 (a zero residual must not reach torch.multinomial).
    draft_tokens = d([0, 1])
    q = t([
        [0.5, 0.5, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0, 0.0],
    ])  # [K, V]
    p = t([
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
    ])  # [K+1, V]
    assert_result(p, q, draft_tokens, (1, 3))


def test_k1_accepted():
    # K = 1, V = 4.
    q = t([[0.25, 0.25, 0.25, 0.25]])  # [K, V]
    p = t([[0.0, 0.0, 0.5, 0.5], [0.0, 1.0, 0.0, 0.0]])  # [K+1, V]
    assert_result(p, q, d([3]), (1, 1))


def test_k1_rejected():
    # K = 1, V = 4; p_1(d_1) = 0 rejects, max(0, p_1 - q_1) = [0, 0, 0.5, 0] is one-hot on 2.
    q = t([[0.25, 0.25, 0.0, 0.5]])  # [K, V]
    p = t([[0.0, 0.0, 0.5, 0.5], [0.0, 1.0, 0.0, 0.0]])  # [K+1, V]
    assert_result(p, q, d([0]), (0, 2))


def test_k0_is_plain_sampling_from_p1():
    # K = 0: q is [0, V], p is [1, V]; the result is one draw from p_1.
    V = 6
    q = torch.zeros(0, V)
    draft_tokens = torch.zeros(0, dtype=torch.int64)
    assert_result(t([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]), q, draft_tokens, (0, 4))
    p = t([[0.1, 0.2, 0.0, 0.3, 0.4, 0.0]])
    for seed in SEEDS:
        expected = draw(p[0], make_generator(seed))
        assert rejection_sample(p, q, draft_tokens, make_generator(seed)) == (0, expected)


def test_partial_acceptance_probability_is_min_p_over_q():
    # K = 1, V = 3; p_1(d_1) / q_1(d_1) = 0.2 / 0.8 = 0.25. Rejection recovers from
    # max(0, p_1 - q_1) = [0, 0, 0.7], one-hot on 2; the bonus row is one-hot on 1. So every result
    # is (1, 1) or (0, 2), and (1, 1) must come up with frequency 0.25 (fixed seeds, so this is
    # deterministic; the bound is 5 binomial standard deviations).
    q = t([[0.8, 0.1, 0.1]])  # [K, V]
    p = t([[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])  # [K+1, V]
    n = 4000
    results = [rejection_sample(p, q, d([0]), make_generator(seed)) for seed in range(n)]
    assert set(results) == {(1, 1), (0, 2)}
    accepted = results.count((1, 1)) / n
    assert abs(accepted - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n), accepted


# --- Greedy ----------------------------------------------------------------------------------


def test_greedy_process_logits_breaks_ties_on_first_index():
    logits = t([
        [1.0, 3.0, 3.0, 0.0],  # tie between 1 and 2 -> 1
        [5.0, 5.0, 5.0, 5.0],  # all tied -> 0
        [-1.0, -2.0, -1.0, -3.0],  # tie between 0 and 2 -> 0
        [0.0, 0.0, 0.0, 7.0],
    ])  # [N, V]
    probs = process_logits(logits, GREEDY)
    assert probs.dtype == torch.float32
    assert torch.equal(probs.argmax(-1), d([1, 0, 0, 3]))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs, torch.nn.functional.one_hot(d([1, 0, 0, 3]), 4).float())
    # Greedy ignores top-k / top-p.
    assert torch.equal(process_logits(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.1)), probs)


@pytest.mark.parametrize(
    "draft, expected",
    [
        ([1, 0, 3], (3, 2)),  # all drafts == argmax p_i -> bonus argmax p_4 = 2
        ([1, 2, 3], (1, 0)),  # d_2 != argmax p_2 = 0 -> stop at 2, next = 0
        ([2, 0, 3], (0, 1)),  # d_1 = 2 ties with argmax p_1 = 1 but is not the first max
        ([1, 0, 0], (2, 3)),  # d_3 != argmax p_3 = 3
    ],
)
def test_greedy_rejection_sampling(draft, expected):
    # K = 3, V = 4. Target logits [K+1, V]; the draft is a deterministic proposer (q one-hot).
    target_logits = t([
        [0.0, 2.0, 2.0, 1.0],  # argmax 1 (tie with 2)
        [3.0, 1.0, 2.0, 0.0],  # argmax 0
        [0.0, 1.0, 2.0, 9.0],  # argmax 3
        [1.0, 1.0, 4.0, 4.0],  # bonus argmax 2 (tie with 3)
    ])
    p = process_logits(target_logits, GREEDY)  # [K+1, V] one-hot
    draft_tokens = d(draft)
    q = dense_q(None, draft_tokens, 4)  # [K, V] one-hot on the drafts
    assert rejection_sample(p, q, draft_tokens, None) == expected
    assert rejection_sample(p, q, draft_tokens, make_generator(7)) == expected


# --- the greedy fast path equals the general function's temperature-0 limit ------------------------


@pytest.mark.parametrize("seed", range(20))
def test_verify_greedy_equals_rejection_sample_on_one_hot(seed):
    from specdec.math.rejection import verify_greedy

    g = torch.Generator().manual_seed(seed)
    k, v = int(torch.randint(0, 6, (1,), generator=g)), 7
    logits = torch.randn(k + 1, v, generator=g)  # [K+1, V]
    argmax = logits.argmax(dim=-1)
    # drafts agree with the target's argmax for a random-length prefix, then (maybe) differ
    agree = int(torch.randint(0, k + 1, (1,), generator=g))
    d = argmax[:k].clone()
    if agree < k:
        d[agree] = (d[agree] + 1 + int(torch.randint(0, v - 1, (1,), generator=g))) % v
    p = process_logits(logits, SamplingParams(temperature=0.0))  # [K+1, V] one-hot
    q = dense_q(None, d, v)  # [K, V] one-hot
    assert verify_greedy(logits, d) == rejection_sample(p, q, d, torch.Generator().manual_seed(0))
