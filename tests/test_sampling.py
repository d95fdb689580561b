"""Exact unit tests for specdec.math (sampling and rejection) (in the style of vLLM's test_rejection_sampler.py).

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
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.math.params import SamplingParams
from specdec.math.rejection import dense_q, rejection_sample
from specdec.math.sampling import make_generator, process_logits, sample, truncate_top_n
from specdec.math.seeds import DRAFT_STREAM, TARGET_STREAM, derive_seed

SEEDS = range(64)
GREEDY = SamplingParams(temperature=0.0)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def d(tokens) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


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
        expected = int(torch.multinomial(p[0], 1, generator=make_generator(seed))[0])
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


# --- process_logits ----------------------------------------------------------------------------


def test_process_logits_temperature_is_softmax_of_scaled_logits():
    logits = torch.randn(3, 7, generator=make_generator(0))  # [N, V]
    for temperature in (0.3, 1.0, 2.5):
        probs = process_logits(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(probs, (logits / temperature).softmax(-1))
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_process_logits_accepts_half_precision_and_returns_float32():
    logits = torch.randn(2, 5, generator=make_generator(1)).to(torch.bfloat16)
    probs = process_logits(logits, SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits.float().softmax(-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = t([[1.0, 4.0, 2.0, 3.0, 0.0]])  # [1, V]
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(1, 5)
    expected[0, [1, 3]] = t([4.0, 3.0]).softmax(-1)
    torch.testing.assert_close(probs, expected)
    # top_k >= V is no filter.
    torch.testing.assert_close(
        process_logits(logits, SamplingParams(temperature=1.0, top_k=5)), logits.softmax(-1)
    )
    torch.testing.assert_close(
        process_logits(logits, SamplingParams(temperature=1.0, top_k=50)), logits.softmax(-1)
    )


def test_top_k_keeps_ties_with_the_kth_value():
    # Hugging Face keeps every token whose logit equals the k-th largest.
    logits = t([[1.0, 3.0, 2.0, 3.0, 2.0]])
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs[0] > 0).tolist() == [False, True, True, True, True]


def test_top_p_keeps_smallest_set_reaching_top_p():
    base = t([[0.15, 0.5, 0.05, 0.3]])  # [1, V]
    logits = base.log()
    # Sorted descending: 0.5, 0.3 (cum 0.8), 0.15 (cum 0.95), 0.05.
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(probs, t([[0.0, 0.625, 0.0, 0.375]]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    torch.testing.assert_close(probs, t([[0.15, 0.5, 0.0, 0.3]]) / 0.95)
    # A tiny top_p still keeps the most likely token (1 - 1e-9 rounds to 1.0 in float32, so this
    # needs the explicit "keep at least one" rule).
    for top_p in (0.01, 1e-9):
        probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        torch.testing.assert_close(probs, t([[0.0, 1.0, 0.0, 0.0]]))
    # top_p = 1 is no filter.
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=1.0, top_p=1.0)), base)


def test_top_p_exact_boundary_and_ties_match_transformers():
    # Uniform logits: softmax is exactly 0.25 each and the cumulative sums 0.25, 0.5, 0.75, 1.0 are
    # exact, so top_p = 0.5 sits exactly on a boundary: the smallest set reaching 0.5 has 2 tokens
    # (HF removes tokens whose ascending cumulative mass is <= 1 - top_p). Which tied tokens survive
    # follows HF's sort, so compare with HF directly.
    logits = torch.zeros(1, 4)
    for top_p, n_kept in ((0.25, 1), (0.5, 2), (0.75, 3), (0.8, 4)):
        probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert int((probs > 0).sum()) == n_kept, top_p
        torch.testing.assert_close(probs[probs > 0], torch.full((n_kept,), 1.0 / n_kept))
        # Which of several exactly tied tokens fills the boundary is not part of the contract (HF's
        # answer comes from its unstable full sort): compare the kept probabilities as a multiset.
        hf = TopPLogitsWarper(top_p)(None, logits.clone()).softmax(-1)
        torch.testing.assert_close(probs.sort(-1).values, hf.sort(-1).values)


def _hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(-1)


HF_SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.3),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.7),
    SamplingParams(temperature=0.6, top_k=3, top_p=0.95),
]


@pytest.mark.parametrize("params", HF_SETTINGS, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "integer-ties"])
def test_process_logits_matches_transformers(params: SamplingParams, ties: bool):
    logits = 3.0 * torch.randn(16, 50, generator=make_generator(11))  # [N, V]
    if ties:
        logits = logits.round()  # many exact ties, to check Hugging Face's tie rules
    expected = _hf_probs(logits, params)
    probs = process_logits(logits, params)
    if ties and params.top_p < 1.0:
        # Exact ties at the nucleus boundary: the same number of tokens with the same probabilities
        # (which tied index is kept is unspecified; see test_top_p_exact_boundary_and_ties...).
        torch.testing.assert_close(probs.sort(-1).values, expected.sort(-1).values)
        assert torch.equal((probs > 0).sum(-1), (expected > 0).sum(-1))
        return
    torch.testing.assert_close(probs, expected)
    assert torch.equal(probs > 0, expected > 0)  # identical supports, not just close values


def test_sampling_params_validate():
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=3, top_p=0.5).validate()
    for bad, field in [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_p=math.nan), "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            bad.validate()


# --- truncate_top_n / dense_q ------------------------------------------------------------------


def test_truncate_top_n():
    probs = t([0.05, 0.0, 0.5, 0.3, 0.15, 0.0])  # [V]
    ids, vals = truncate_top_n(probs, 3)
    assert ids.tolist() == [2, 3, 4]
    assert ids.dtype == torch.int64
    torch.testing.assert_close(vals, t([0.5, 0.3, 0.15]) / 0.95)
    # n larger than the support (or than V): only the non-zero entries, most likely first.
    for n in (5, 6, 100):
        ids, vals = truncate_top_n(probs, n)
        assert ids.tolist() == [2, 3, 4, 0]
        assert (vals > 0).all()
        torch.testing.assert_close(vals.sum(), torch.tensor(1.0))
        torch.testing.assert_close(vals, t([0.5, 0.3, 0.15, 0.05]))
    ids, vals = truncate_top_n(probs, 1)
    assert ids.tolist() == [2] and vals.tolist() == [1.0]


def test_dense_q_one_hot_rows_when_none():
    draft_tokens = d([3, 0, 3])  # [K]
    q = dense_q(None, draft_tokens, 5)  # [K, V]
    assert q.dtype == torch.float32
    assert torch.equal(q, t([
        [0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0],
    ]))


def test_dense_q_scatters_sparse_rows():
    draft_tokens = d([2, 4])  # [K]
    rows = [
        (d([2, 0]), t([0.75, 0.25])),
        (d([4, 1, 3]), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)),
    ]
    q = dense_q(rows, draft_tokens, 6)  # [K, V]
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, t([
        [0.25, 0.0, 0.75, 0.0, 0.0, 0.0],
        [0.0, 0.3, 0.0, 0.2, 0.5, 0.0],
    ]))
    # Round trip with truncate_top_n, as the draft sends it and the target rebuilds it.
    probs = t([0.1, 0.6, 0.0, 0.3])
    q = dense_q([truncate_top_n(probs, 2)], d([1]), 4)
    torch.testing.assert_close(q, t([[0.0, 2 / 3, 0.0, 1 / 3]]))


# --- Seeds and determinism ---------------------------------------------------------------------


def test_derive_seed_deterministic_distinct_and_63_bit():
    seeds = {}
    for seed in (0, 1, 12345, 2**63 - 1, 2**64 - 1):
        for position in range(200):
            for stream in (DRAFT_STREAM, TARGET_STREAM):
                s = derive_seed(seed, position, stream)
                assert s == derive_seed(seed, position, stream)
                assert 0 <= s < 2**63
                seeds[(seed, position, stream)] = s
    assert len(set(seeds.values())) == len(seeds)  # differs across request seed, position, stream
    assert DRAFT_STREAM != TARGET_STREAM
    # Usable as a torch seed.
    make_generator(derive_seed(2**64 - 1, 0, TARGET_STREAM))


def test_derive_seed_golden_values():
    # Pinned: every tier (and every version of it) must derive the same seeds, or a session moved
    # to another replica would draw different numbers.
    assert derive_seed(0, 0, DRAFT_STREAM) == 1700482428262628912
    assert derive_seed(0, 0, TARGET_STREAM) == 6432871004036475287
    assert derive_seed(42, 17, TARGET_STREAM) == 6324174209512480805
    assert derive_seed(2**64 - 1, 1000, DRAFT_STREAM) == 747193127767688134
    assert derive_seed(-1, 1000, DRAFT_STREAM) == derive_seed(2**64 - 1, 1000, DRAFT_STREAM)


def test_make_generator_same_seed_same_draws():
    s = derive_seed(42, 17, TARGET_STREAM)
    a = torch.rand(8, generator=make_generator(s))
    b = torch.rand(8, generator=make_generator(s))
    c = torch.rand(8, generator=make_generator(derive_seed(42, 17, DRAFT_STREAM)))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    probs = t([0.1, 0.2, 0.3, 0.4])
    assert [sample(probs, make_generator(s)) for _ in range(5)] == [sample(probs, make_generator(s))] * 5


def test_rejection_sample_same_seed_same_result():
    # K = 3, V = 6, random (non-degenerate) p and q: results vary with the seed but not across
    # repeats of one seed.
    g = make_generator(0)
    p = torch.rand(4, 6, generator=g).softmax(-1) ** 3  # [K+1, V]
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(3, 6, generator=g).softmax(-1)  # [K, V]
    draft_tokens = d([1, 4, 2])
    results = []
    for seed in range(50):
        s = derive_seed(seed, 0, TARGET_STREAM)
        r = rejection_sample(p, q, draft_tokens, make_generator(s))
        assert r == rejection_sample(p, q, draft_tokens, make_generator(s))
        results.append(r)
    assert len(set(results)) > 3  # the seed matters


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


def test_top_p_candidate_search_equals_full_sort():
    import specdec.math.sampling as sm

    g = torch.Generator().manual_seed(0)
    # peaked rows (nucleus inside the candidates) and flat rows (nucleus wider: full-sort fallback)
    logits = torch.cat([torch.randn(4, 5000, generator=g) * 6, torch.randn(4, 5000, generator=g) * 0.01])
    for top_p in (0.1, 0.5, 0.9, 0.99):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        fast = process_logits(logits, params)
        saved, sm.TOP_P_CANDIDATES = sm.TOP_P_CANDIDATES, 10**9
        try:
            full = process_logits(logits, params)
        finally:
            sm.TOP_P_CANDIDATES = saved
        assert torch.equal(fast > 0, full > 0)
        assert torch.allclose(fast, full, atol=1e-7)
