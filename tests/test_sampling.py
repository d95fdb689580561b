"""Exact unit tests of the sampling transforms (specdec/math/sampling.py, specdec/math/params.py):
temperature, top-k and top-p as process_logits applies them (matched against transformers' own logits
warpers, ties included), the parameters' validation, and the sparse q rows the draft sends
(truncate_top_n) as the target rebuilds them (dense_q).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.math.params import SamplingParams
from specdec.math.rejection import dense_q
from specdec.math.sampling import make_generator, process_logits, truncate_top_n
from tests.math_cases import d, t


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
