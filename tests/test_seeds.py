"""Exact unit tests of the seeds (specdec/math/seeds.py): per-position, per-stream seeds derived from a
request's seed are deterministic, distinct and pinned to golden values, and equal seeds give equal draws.
"""

from __future__ import annotations

import torch

from specdec.math.rejection import rejection_sample
from specdec.math.draw import draw
from specdec.math.sampling import make_generator
from specdec.math.seeds import DRAFT_STREAM, TARGET_STREAM, derive_seed
from tests.math_cases import d, t


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
    assert [draw(probs, make_generator(s)) for _ in range(5)] == [draw(probs, make_generator(s))] * 5


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
