"""Speculative sampling with penalties keeps the penalised target's law exactly (tests/test_distribution.py's
harness, with history-dependent distributions). A bigram "model" (target logits T[prev], draft logits
D[prev]) processed with presence / frequency / repetition penalties and logit_bias, so p and q depend on
every token so far. Each round drafts K tokens from q (the draft's own penalised rows), verifies them with
the target's K+1 rows built the way the engine builds them (process_logits_rows with TokenCounts over the
committed tokens plus d_1..d_i per row), and the empirical joint of the first N_TOKENS is compared with
the exact joint of the penalised target decoding one token at a time. A negative control that counts only
the committed tokens at every row (ignoring the drafts before it) must be rejected by the same test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts
from specdec.math.rejection import rejection_sample
from specdec.math.sampling import process_logits, process_logits_rows
from tests.test_distribution import NEGATIVE_PVALUE_MAX, assert_matches_target, goodness_of_fit

pytestmark = pytest.mark.slow

V, START, N_TOKENS, K = 5, 0, 3, 2
PROMPT_LEN = 1  # the prompt is [START]
N_TRIALS = 12_000
N_TRIALS_NEGATIVE = 6_000
PARAMS = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.7, repetition_penalty=1.6,
                        logit_bias=((3, 1.0),))

_g = torch.Generator().manual_seed(4321)
T = 1.5 * torch.randn(V, V, generator=_g)  # target logits [prev, next]
D = 0.5 * T + 1.2 * torch.randn(V, V, generator=_g)  # draft logits: correlated, not equal


def one_row(logits_table: torch.Tensor, seq: tuple[int, ...]) -> torch.Tensor:
    """The penalised distribution after seq, one position on its own (what the target alone computes)."""
    counts = TokenCounts.at_positions(seq, PROMPT_LEN, len(seq), 1, 0, V)
    return process_logits(logits_table[seq[-1]][None], PARAMS, counts)[0]


def exact_joint() -> np.ndarray:
    joint = np.zeros((V,) * N_TOKENS)
    for toks in itertools.product(range(V), repeat=N_TOKENS):
        seq, prob = (START,), 1.0
        for t in toks:
            prob *= float(one_row(T, seq)[t])
            seq = seq + (t,)
        joint[toks] = prob
    return joint / joint.sum()


def verify_rows(committed: tuple[int, ...], drafts: tuple[int, ...], see_drafts: bool) -> torch.Tensor:
    """The target's K+1 rows as the engine builds them; see_drafts=False is the WRONG variant."""
    seq = committed + drafts
    logits = T[list(seq[len(committed) - 1:])]  # [K+1, V]
    if see_drafts:
        counts = TokenCounts.at_positions(seq, PROMPT_LEN, len(committed), len(drafts) + 1, 0, V)
    else:
        one = TokenCounts.at_positions(committed, PROMPT_LEN, len(committed), 1, 0, V)
        n = len(drafts) + 1
        counts = TokenCounts(torch.arange(n), one.output.expand(n, V), one.seen.expand(n, V))
    return process_logits_rows(logits, [PARAMS] * (len(drafts) + 1), counts)


def run(n_trials: int, seed: int, see_drafts: bool = True) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    q_cache: dict = {}
    p_cache: dict = {}
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for _ in range(n_trials):
        seq = (START,)
        while len(seq) - 1 < N_TOKENS:
            drafts, qs = (), []
            for _ in range(K):  # the draft's own penalised rows, its proposals counted
                key = seq + drafts
                if key not in q_cache:
                    q_cache[key] = one_row(D, key)
                qs.append(q_cache[key])
                drafts = drafts + (int(torch.multinomial(qs[-1], 1, generator=gen)[0]),)
            key = (seq, drafts)
            if key not in p_cache:
                p_cache[key] = verify_rows(seq, drafts, see_drafts)
            n, nxt = rejection_sample(p_cache[key], torch.stack(qs), torch.tensor(drafts), gen)
            seq = seq + drafts[:n] + (nxt,)
        counts[seq[1 : N_TOKENS + 1]] += 1
    return counts


def test_penalised_speculative_sampling_matches_the_penalised_target():
    assert_matches_target(run(N_TRIALS, seed=1), exact_joint())


def test_rows_that_ignore_the_drafts_before_them_are_detected():
    pvalue, _, _ = goodness_of_fit(run(N_TRIALS_NEGATIVE, seed=2, see_drafts=False), exact_joint())
    assert pvalue < NEGATIVE_PVALUE_MAX, pvalue


def test_the_penalties_matter_here():
    """Not vacuous: the penalised joint is far from the unpenalised one."""
    plain = process_logits(T, SamplingParams(temperature=1.0)).double().numpy()
    joint = np.zeros((V,) * N_TOKENS)
    for a, b, c in itertools.product(range(V), repeat=3):
        joint[a, b, c] = plain[START, a] * plain[a, b] * plain[b, c]
    assert 0.5 * np.abs(joint - exact_joint()).sum() > 0.1
