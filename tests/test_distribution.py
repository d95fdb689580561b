"""Statistical tests: speculative sampling reproduces the target distribution exactly.

A tiny synthetic "model": V tokens and bigram tables, P[prev] -> target distribution p and
Q[prev] -> draft distribution q (seeded random logits, both processed by `process_logits` with the
SamplingParams under test). Starting from a fixed token we generate the first N_TOKENS tokens with
the draft/verify loop (draft d_1..d_K from q autoregressively, target rows p_1..p_{K+1} given the
draft prefix) and compare the empirical joint of those tokens with the exact target joint
    P(t_1, ..., t_n) = p(t_1 | START) * p(t_2 | t_1) * ... * p(t_n | t_{n-1})
by a chi-square goodness-of-fit test and a total-variation bound.

Negative controls run the same harness with deliberately wrong verifiers and must be rejected by
the same criterion, proving the test has power. All seeds are fixed: the tests are deterministic.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.math.draw import draw
from specdec.math.params import SamplingParams
from specdec.math.rejection import dense_q, rejection_sample, rejection_sample_batched, round_randomness
from specdec.math.sampling import process_logits, truncate_top_n

pytestmark = pytest.mark.slow

V = 5  # vocab size
START = 0  # the fixed context token
N_TOKENS = 3  # length of the generated prefix whose joint distribution we test
K = 2  # draft tokens per round (so 3 tokens exercise the bonus path: 2 accepted + 1 bonus)
N_TRIALS = 15_000  # ~2.5 s per run on one CPU core
N_TRIALS_ONE_HOT = 12_000  # more rounds per trial: a fixed proposal is rejected often
N_TRIALS_NEGATIVE = 4_000  # plenty: the wrong verifiers below give p-values < 1e-100

GOF_PVALUE_MIN = 1e-3  # a correct sampler must pass
NEGATIVE_PVALUE_MAX = 1e-6  # a wrong sampler must fail


# --- The synthetic model ------------------------------------------------------------------------


def make_tables(params: SamplingParams, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """p = P[prev] [V, V] target bigram, q = Q[prev] [V, V] draft bigram (a different model)."""
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(V, V, generator=g)  # [V(prev), V(next)]
    draft_logits = 0.5 * target_logits + 1.2 * torch.randn(V, V, generator=g)  # correlated, not equal
    return process_logits(target_logits, params), process_logits(draft_logits, params)


def exact_joint(P: torch.Tensor, n_tokens: int = N_TOKENS) -> np.ndarray:
    """Exact target joint of the first n_tokens after START: [V] * n_tokens, float64."""
    p = P.double().numpy()
    p = p / p.sum(-1, keepdims=True)
    joint = p[START]  # [V]
    for _ in range(n_tokens - 1):
        joint = joint[..., None] * p  # J[..., a, b] = J[..., a] * p(b | a)
    return joint


# --- Verifiers ----------------------------------------------------------------------------------


def verify_residual_from_p(p, q, draft_tokens, generator):
    """WRONG on purpose: draws the recovered token from p_j instead of norm(max(0, p_j - q_j))."""
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    for i in range(k):
        d = int(draft_tokens[i])
        if not (q[i, d] > 0 and u[i] * q[i, d] < p[i, d]):
            return i, int(torch.multinomial(p[i], 1, generator=generator)[0])
    return k, int(torch.multinomial(p[k], 1, generator=generator)[0])


def verify_bonus_off_by_one(p, q, draft_tokens, generator):
    """WRONG on purpose: correct accept/residual, but the bonus token is drawn from p_K, not p_{K+1}."""
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    for i in range(k):
        d = int(draft_tokens[i])
        if not (q[i, d] > 0 and u[i] * q[i, d] < p[i, d]):
            residual = (p[i] - q[i]).clamp_min(0)
            dist = residual if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(dist, 1, generator=generator)[0])
    return k, int(torch.multinomial(p[k - 1], 1, generator=generator)[0])


# --- The harness --------------------------------------------------------------------------------


def _cdf_rows(Q: torch.Tensor) -> list[tuple[list[float], int]]:
    rows = []
    for row in Q.double():
        row = row / row.sum()
        last_nonzero = int(row.nonzero().max())
        rows.append((row.cumsum(0).tolist(), last_nonzero))
    return rows


def _draw(cdf: tuple[list[float], int], u: float) -> int:
    """Inverse-CDF draw; never returns a zero-probability token."""
    cum, last_nonzero = cdf
    return min(bisect.bisect_right(cum, u), last_nonzero)


def run_chain(verify, P: torch.Tensor, Q: torch.Tensor, *, n_trials: int, seed: int, k: int = K) -> np.ndarray:
    """Counts of the first N_TOKENS generated after START over n_trials runs: [V] * N_TOKENS.

    P: [V, V] target rows p(. | prev). Q: [V, V] draft rows q(. | prev), which are both what the
    draft samples from and what the verifier is told. One generator, seeded once, drives the draft
    draws and the verifier.
    """
    gen = torch.Generator().manual_seed(seed)
    cdfs = _cdf_rows(Q)
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for _ in range(n_trials):
        out: list[int] = []
        while len(out) < N_TOKENS:
            ctx = out[-1] if out else START
            u = torch.rand(k, generator=gen, dtype=torch.float64).tolist()
            drafts = []
            prev = ctx
            for i in range(k):  # d_i ~ q(. | d_{i-1}), autoregressively
                prev = _draw(cdfs[prev], u[i])
                drafts.append(prev)
            rows = [ctx] + drafts
            p = P[rows]  # [K+1, V]: p_i = p(. | ctx, d_1..d_{i-1}); p_{K+1} is the bonus row
            q = Q[rows[:k]]  # [K, V]: q_i = q(. | ctx, d_1..d_{i-1})
            n_accepted, next_token = verify(p, q, torch.tensor(drafts), gen)
            assert 0 <= n_accepted <= k
            out += drafts[:n_accepted] + [next_token]
        counts[tuple(out[:N_TOKENS])] += 1
    return counts


def run_chains_batched(P: torch.Tensor, Q: torch.Tensor, *, n_trials: int, seed: int) -> np.ndarray:
    return run_chains_batched_with(P, Q, Q, n_trials=n_trials, seed=seed)


def run_chains_batched_with(P: torch.Tensor, Q: torch.Tensor, Q_told: torch.Tensor, *, n_trials: int, seed: int) -> np.ndarray:
    """run_chain's counts, but every trial is a session of one ragged batch: all unfinished chains
    verify their round together in one rejection_sample_batched call, each with its own K (0..3,
    so K = 0 sessions ride along) and its own generator."""
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + t) for t in range(n_trials)]
    ks = [t % 4 for t in range(n_trials)]
    cdfs = _cdf_rows(Q)
    outs: list[list[int]] = [[] for _ in range(n_trials)]
    active = list(range(n_trials))
    while active:
        p_rows, q_rows, drafts_all, counts_k = [], [], [], []
        for t in active:
            k = ks[t]
            ctx = outs[t][-1] if outs[t] else START
            u = torch.rand(k, generator=gens[t], dtype=torch.float64).tolist()
            drafts, prev = [], ctx
            for i in range(k):
                prev = _draw(cdfs[prev], u[i])
                drafts.append(prev)
            rows = [ctx] + drafts
            p_rows.append(P[rows])
            q_rows.append(Q_told[rows[:k]])  # what the verifier is told q was
            drafts_all.append(drafts)
            counts_k.append(k)
        cu = torch.tensor([0] + counts_k).cumsum(0)
        uniform, at = round_randomness([gens[t] for t in active], counts_k)
        n_acc, nxt = rejection_sample_batched(torch.cat(p_rows), torch.cat(q_rows),
                                              torch.tensor([d for ds in drafts_all for d in ds], dtype=torch.long),
                                              cu, uniform, at)
        for t, drafts, n, tok in zip(active, drafts_all, n_acc.tolist(), nxt.tolist()):
            outs[t] += drafts[:n] + [tok]
        active = [t for t in active if len(outs[t]) < N_TOKENS]
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for out in outs:
        counts[tuple(out[:N_TOKENS])] += 1
    return counts


def goodness_of_fit(counts: np.ndarray, joint: np.ndarray) -> tuple[float, float, float]:
    """(chi-square p-value, total-variation distance, TV expected from sampling noise alone).

    Cells impossible under the target are excluded (the caller asserts they are empty); cells with
    expected count < 5 are merged into one bucket.
    """
    n = int(counts.sum())
    obs = counts.ravel().astype(np.float64)
    exp = joint.ravel() * n
    possible = exp > 0
    obs, exp = obs[possible], exp[possible]
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    exp = exp * (obs.sum() / exp.sum())
    pvalue = float(chisquare(obs, exp).pvalue)
    tv = 0.5 * float(np.abs(counts / n - joint).sum())
    pj = joint.ravel()
    noise_tv = 0.5 * float(np.sqrt(2.0 * pj * (1.0 - pj) / (math.pi * n)).sum())  # E|emp - p| summed
    return pvalue, tv, noise_tv


def assert_matches_target(counts: np.ndarray, joint: np.ndarray) -> None:
    # Exact support: nothing may be generated that the target gives probability 0.
    assert counts[joint == 0].sum() == 0, "generated a sequence of target probability 0"
    pvalue, tv, noise_tv = goodness_of_fit(counts, joint)
    assert pvalue > GOF_PVALUE_MIN, f"chi-square p={pvalue:.3g}, TV={tv:.4f} (noise ~{noise_tv:.4f})"
    # TV of a correct sampler is ~noise_tv (its spread ~20%: 0.76-1.53x over 30 seeds of the one-hot case).
    assert tv < 1.5 * noise_tv, f"TV={tv:.4f} vs noise ~{noise_tv:.4f}"


# --- Tests --------------------------------------------------------------------------------------

PARAMS = [
    pytest.param(SamplingParams(temperature=1.0), id="t1.0"),
    pytest.param(SamplingParams(temperature=0.7, top_k=3), id="t0.7-topk3"),
    pytest.param(SamplingParams(temperature=1.0, top_p=0.8), id="t1.0-topp0.8"),
]


@pytest.mark.parametrize("params", PARAMS)
def test_speculative_sampling_matches_target(params: SamplingParams):
    P, Q = make_tables(params)
    assert not torch.allclose(P, Q)  # the draft really is a different model
    counts = run_chain(rejection_sample, P, Q, n_trials=N_TRIALS, seed=0)
    assert_matches_target(counts, exact_joint(P))


@pytest.mark.parametrize("params", PARAMS)
def test_batched_verification_matches_target(params: SamplingParams):
    """The same check through the ragged batched verifier the target engine runs."""
    P, Q = make_tables(params)
    counts = run_chains_batched(P, Q, n_trials=N_TRIALS, seed=5)
    assert_matches_target(counts, exact_joint(P))


def test_batched_verification_with_a_wrong_residual_is_detected():
    """Negative control for the batched path: with q's row made wrong (q swapped for a different
    table when the residual is taken, i.e. verified against a q the draft did not sample from) the
    same criterion must reject it."""
    P, Q = make_tables(SamplingParams(temperature=1.0))
    _, Q_other = make_tables(SamplingParams(temperature=1.0), seed=99)

    def skewed(P_, Q_, **kw):  # drafts drawn from Q, verified as if from Q_other
        return run_chains_batched_with(P_, Q_, Q_other, **kw)

    counts = skewed(P, Q, n_trials=N_TRIALS_NEGATIVE, seed=6)
    pvalue, tv, noise_tv = goodness_of_fit(counts, exact_joint(P))
    assert pvalue < NEGATIVE_PVALUE_MAX, f"wrong batched verifier passed: p={pvalue:.3g}"


def test_truncated_draft_matches_target():
    """The pipeline's draft samples from, and sends, its top-n truncated q (truncate_top_n ->
    dense_q); q then has zeros where p does not, which only the residual can make up for."""
    params = SamplingParams(temperature=1.0)
    P, Q = make_tables(params)
    Q2 = dense_q([truncate_top_n(Q[prev], 2) for prev in range(V)], torch.arange(V), V)  # [V, V]
    assert ((Q2 == 0) & (P > 0)).any()
    counts = run_chain(rejection_sample, P, Q2, n_trials=N_TRIALS, seed=1)
    assert_matches_target(counts, exact_joint(P))


def test_a_one_hot_offer_matched_against_the_target_has_its_acceptance_law():
    """Why a model-free strategy's offer that was not chosen is judged in a sampled session too
    (coordinator/proposers/local.py): for a deterministic offer d_1..d_K (q one-hot), the drafts
    rejection_sample accepts and the leading tokens of the target's own sample that equal the offer have one
    law, P(n >= i) = prod_{j <= i} p_j(d_j). Both counts are checked against it."""
    P, _ = make_tables(SamplingParams(temperature=1.0))
    d1 = int(P[START].argmax())
    d2 = int(P[d1].argsort(descending=True)[1])  # the second likeliest: a mixed outcome
    offer = torch.tensor([d1, d2])
    reach = [1.0, float(P[START, d1]), float(P[START, d1] * P[d1, d2])]  # P(n >= 0, 1, 2)
    law = np.array([reach[0] - reach[1], reach[1] - reach[2], reach[2]])  # P(n = 0, 1, 2)
    p, q = P[[START, d1, d2]], dense_q(None, offer, V)
    gen = torch.Generator().manual_seed(11)
    accepted, matched = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    for _ in range(N_TRIALS):
        accepted[rejection_sample(p, q, offer, gen)[0]] += 1
        x1 = draw(P[START], gen)  # the target alone: its first token, then (if it is d_1) its second
        matched[0 if x1 != d1 else 1 + (draw(P[d1], gen) == d2)] += 1
    for counts in (accepted, matched):
        assert chisquare(counts, law * N_TRIALS).pvalue > GOF_PVALUE_MIN, (counts, law * N_TRIALS)


def test_deterministic_proposer_matches_target():
    """A deterministic proposer (q one-hot on its proposal, as dense_q(None, ...) builds it) must
    still give exactly p, including when p gives the proposal probability 0 (top_k)."""
    params = SamplingParams(temperature=0.8, top_k=3)
    P, _ = make_tables(params)
    proposals = torch.tensor([(2 * prev + 1) % V for prev in range(V)])  # proposal after each prev
    Q1 = dense_q(None, proposals, V)  # [V, V] one-hot rows
    assert (P[torch.arange(V), proposals] == 0).any()  # some proposals are outside p's support
    # seed 3: with the inverse-CDF draw, seed 2's realisation had TV 1.53x its noise (p = 0.014); over 30 seeds
    # the ratio ran 0.76-1.53 and the p-values were uniform (mean 0.45), as a correct sampler's are
    counts = run_chain(rejection_sample, P, Q1, n_trials=N_TRIALS_ONE_HOT, seed=3)
    assert_matches_target(counts, exact_joint(P))


@pytest.mark.parametrize(
    "wrong_verify",
    [
        pytest.param(verify_residual_from_p, id="recovered-from-p"),
        pytest.param(verify_bonus_off_by_one, id="bonus-off-by-one"),
    ],
)
def test_negative_control_wrong_verifier_is_detected(wrong_verify):
    """Same harness, same criterion: a wrong verifier must be rejected, or the tests above prove
    nothing."""
    P, Q = make_tables(SamplingParams(temperature=1.0))
    counts = run_chain(wrong_verify, P, Q, n_trials=N_TRIALS_NEGATIVE, seed=3)
    pvalue, tv, noise_tv = goodness_of_fit(counts, exact_joint(P))
    assert pvalue < NEGATIVE_PVALUE_MAX, f"wrong verifier passed: p={pvalue:.3g}, TV={tv:.4f}"
    assert tv > 1.5 * noise_tv


def test_negative_control_correct_verifier_passes_on_same_budget():
    """The correct verifier passes with the negative controls' (smaller) trial budget and seed,
    so their failure is due to the verifier, not to the budget."""
    P, Q = make_tables(SamplingParams(temperature=1.0))
    counts = run_chain(rejection_sample, P, Q, n_trials=N_TRIALS_NEGATIVE, seed=3)
    assert_matches_target(counts, exact_joint(P))
