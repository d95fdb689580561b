"""Exact unit tests of the ragged, batched verifier against the per-session reference.

rejection_sample (one session) stays the reference; rejection_sample_batched must give every session
of a ragged batch exactly what the reference gives it with the same generator, whatever else is in
the batch: K = 0 sessions, q(d) = 0, zero residuals, one-hot q and truncated q side by side.
"""

from __future__ import annotations

import pytest
import torch

from specdec.math.draw import draw, inverse_cdf
from specdec.math.params import SamplingParams
from specdec.math.rejection import (dense_q, rejection_sample, rejection_sample_batched, round_randomness,
                                    verify_greedy, verify_greedy_batched)
from specdec.math.sampling import make_generator, process_logits, process_logits_rows, truncate_top_n
from tests.helpers import TEST_DEVICE

V = 50
DEVICE = torch.device(TEST_DEVICE)  # the cases are built on the CPU; both verifiers run here


def ragged_case(seed: int, ks: list[int], kinds: list[str]):
    """Per session: p [K+1, V], q [K, V], drafts [K]; kinds choose how q and the drafts are made."""
    g = torch.Generator().manual_seed(seed)
    sessions = []
    for k, kind in zip(ks, kinds):
        p = process_logits(torch.randn(k + 1, V, generator=g) * 3, SamplingParams(temperature=1.0, top_k=20))
        if kind == "one_hot":
            drafts = torch.randint(0, V, (k,), generator=g)
            q = dense_q(None, drafts, V)
        elif kind == "truncated":
            full = process_logits(torch.randn(k, V, generator=g) * 3, SamplingParams(temperature=1.0))
            rows = [truncate_top_n(full[i], 5) for i in range(k)]
            q = dense_q(rows, torch.zeros(k, dtype=torch.long), V)
            drafts = torch.stack([ids[torch.multinomial(pr, 1, generator=g)[0]] for ids, pr in rows]) if k else torch.zeros(0, dtype=torch.long)
        elif kind == "q_equals_p":  # every draft accepted or a zero residual
            q = p[:k].clone()
            drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)]) if k else torch.zeros(0, dtype=torch.long)
        else:  # "q_zero": drafts the draft gives probability 0 (rejected)
            q = process_logits(torch.randn(k, V, generator=g), SamplingParams(temperature=1.0, top_k=3))
            drafts = torch.stack([(q[i] == 0).nonzero()[0, 0] for i in range(k)]) if k else torch.zeros(0, dtype=torch.long)
        sessions.append((p, q, drafts.long()))
    return sessions


def batched(sessions, seeds, device=torch.device("cpu")):
    ks = [d.shape[0] for _, _, d in sessions]
    cu = torch.tensor([0] + ks).cumsum(0).to(device)
    p = torch.cat([s[0] for s in sessions]).to(device)
    q = (torch.cat([s[1] for s in sessions]) if sum(ks) else torch.zeros(0, V)).to(device)
    drafts = torch.cat([s[2] for s in sessions]).to(device)
    uniform, at = round_randomness([make_generator(s, device) for s in seeds], ks, device)
    return rejection_sample_batched(p, q, drafts, cu, uniform, at)


KINDS = ["one_hot", "truncated", "q_equals_p", "q_zero"]


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_reference_per_session(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    b = int(torch.randint(1, 9, (1,), generator=g))
    ks = torch.randint(0, 6, (b,), generator=g).tolist()
    kinds = [KINDS[int(i)] for i in torch.randint(0, len(KINDS), (b,), generator=g)]
    sessions = ragged_case(seed, ks, kinds)
    seeds = [seed * 100 + i for i in range(b)]
    n, nxt = batched(sessions, seeds, DEVICE)
    for i, (p, q, d) in enumerate(sessions):
        reference = rejection_sample(p.to(DEVICE), q.to(DEVICE), d.to(DEVICE), make_generator(seeds[i], DEVICE))
        assert (int(n[i]), int(nxt[i])) == reference, (i, ks[i], kinds[i])


def test_batched_outcome_does_not_depend_on_the_rest_of_the_batch():
    sessions = ragged_case(7, [3, 0, 5, 2], ["truncated", "one_hot", "q_equals_p", "q_zero"])
    seeds = [11, 12, 13, 14]
    n, nxt = batched(sessions, seeds)
    for i in range(4):
        alone = batched([sessions[i]], [seeds[i]])
        assert (int(alone[0][0]), int(alone[1][0])) == (int(n[i]), int(nxt[i]))


def test_batched_edge_cases_named():
    # q(d) = 0 always rejects at the first position; q == p accepts everything (K drafts + bonus).
    sessions = ragged_case(3, [4, 4], ["q_zero", "q_equals_p"])
    n, _ = batched(sessions, [1, 2])
    assert int(n[0]) == 0
    assert int(n[1]) == 4
    # All sessions K = 0: plain sampling from p_1.
    sessions = ragged_case(4, [0, 0, 0], ["one_hot"] * 3)
    n, nxt = batched(sessions, [5, 6, 7])
    assert n.tolist() == [0, 0, 0]
    for i, (p, _, _) in enumerate(sessions):
        assert int(nxt[i]) == draw(p[0], make_generator([5, 6, 7][i]))


def test_zero_residual_falls_back_to_p():
    """q_j == p_j at a rejected position (a draft both give probability 0, so q(d) = 0 rejects): the
    residual is all zero and the recovered token is drawn from p_j."""
    p = torch.zeros(2, V)
    p[0, :2] = 0.5
    p[1, 3] = 1.0
    q = p[:1].clone()
    drafts = torch.tensor([7])  # p(7) = q(7) = 0
    for seed in range(20):
        n, nxt = rejection_sample_batched(p, q, drafts, torch.tensor([0, 1]), *round_randomness([make_generator(seed)], [1]))
        assert (int(n[0]), int(nxt[0])) == rejection_sample(p, q, drafts, make_generator(seed))
        assert int(n[0]) == 0 and int(nxt[0]) in (0, 1)


def test_inverse_cdf_exact_cases():
    """The draw's exact cases: each token owns the interval of its cumulative mass, [cdf_before, cdf);
    tokens of zero mass own none, whatever the point; an unnormalised row is drawn as its normalised one;
    a point that rounding carries to the total falls on the last token with mass, never past it."""
    dist = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 7, device=DEVICE)
    at = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.999999, 1.0], dtype=torch.float64, device=DEVICE)
    assert inverse_cdf(dist, at).tolist() == [1, 1, 3, 3, 4, 4, 4]
    assert inverse_cdf(dist * 8, at).tolist() == [1, 1, 3, 3, 4, 4, 4]  # unnormalised: the same tokens
    one = torch.zeros(1, V, device=DEVICE)
    one[0, 17] = 3.0
    for u in (0.0, 0.5, 1.0 - 2**-53):
        assert inverse_cdf(one, torch.tensor([u], dtype=torch.float64, device=DEVICE)).tolist() == [17]
    g = torch.Generator().manual_seed(0)
    sparse = torch.rand(64, V, generator=g) ** 4
    sparse[torch.rand(64, V, generator=g) < 0.7] = 0
    sparse[:, 0] = 1e-3  # every row some mass
    drawn = inverse_cdf(sparse.to(DEVICE), torch.rand(64, generator=g, dtype=torch.float64).to(DEVICE)).cpu()
    assert bool((sparse[torch.arange(64), drawn] > 0).all())  # never a token of zero mass


def test_draw_takes_one_uniform_from_the_generator():
    """draw(dist, generator) is inverse_cdf at the generator's next float64 uniform (round_randomness and
    the references rely on the order of the draws)."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        dist = torch.rand(V, generator=g).to(DEVICE)
        u = torch.rand(1, generator=make_generator(seed, DEVICE), device=DEVICE, dtype=torch.float64)
        assert draw(dist, make_generator(seed, DEVICE)) == int(inverse_cdf(dist[None], u)[0])


@pytest.mark.parametrize("seed", range(20))
def test_greedy_batched_equals_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 8, (1,), generator=g))
    ks = torch.randint(0, 6, (b,), generator=g).tolist()
    logits, drafts = [], []
    for k in ks:
        lg = torch.randn(k + 1, V, generator=g)
        d = lg[:k].argmax(-1)
        agree = int(torch.randint(0, k + 1, (1,), generator=g))
        if agree < k:
            d[agree] = (d[agree] + 1) % V
        logits.append(lg)
        drafts.append(d)
    n, nxt = verify_greedy_batched(torch.cat(logits), [d.tolist() for d in drafts])
    for i in range(b):
        assert (n[i], nxt[i]) == verify_greedy(logits[i], drafts[i])


def test_process_logits_rows_equals_per_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3), SamplingParams()]
    out = process_logits_rows(logits, params)
    for i, prm in enumerate(params):
        assert torch.equal(out[i], process_logits(logits[i : i + 1], prm)[0])
