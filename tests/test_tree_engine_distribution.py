"""The engine's tree verification (specdec.engine.verify, what the target tier runs after its forward)
keeps the target's distribution exactly: the first N_TOKENS tokens generated round after round through
token trees match the exact target joint (chi-square and total variation, test_distribution's harness),
for deterministic candidate trees (the engine's per-level noise derived from each round's seed), sampled
trees with siblings drawn i.i.d. (SpecInfer's MSS) and without replacement (recursive rejection
sampling). Synthetic bigram tables stand in for the models; each round verifies every trial at once, one
batch of VerifyWorks, as one engine step would. A negative control (every level drawn with the same
noise) must be rejected by the same criterion."""

from __future__ import annotations

import pytest
import torch

import specdec.engine.verify as verify
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT, VerifyWork, _verify_trees
from specdec.math.params import SamplingParams
from specdec.math.seeds import mix64
from tests.test_distribution import (N_TOKENS, START, V, assert_matches_target, exact_joint, goodness_of_fit,
                                     make_tables)

pytestmark = pytest.mark.slow

N_TRIALS = 5_000
PARAMS = SamplingParams(temperature=1.0)
CANDIDATE_TREE = ([0, 1, 2, 3, 4], [-1, -1, 0, 0, 1])  # fixed candidates, whatever the context


def tree_for(scheme: str, prev: int, Q: torch.Tensor, gen: torch.Generator):
    """(tokens, parents, q rows or None): two root children and one child under each."""
    if scheme == CANDIDATES:
        tokens, parents = CANDIDATE_TREE
        return list(tokens), list(parents), None
    if scheme == IID:
        roots = torch.multinomial(Q[prev], 2, replacement=True, generator=gen).tolist()
        rows = [Q[prev], Q[prev]]
    else:
        roots = torch.multinomial(Q[prev], 2, replacement=False, generator=gen).tolist()
        rows = [Q[prev], Q[prev]]  # each sibling carries its parent's row; the verifier removes earlier siblings
    kids = [int(torch.multinomial(Q[r], 1, generator=gen)) for r in roots]
    rows += [Q[r] for r in roots]
    q = DraftProbs.from_rows([(torch.arange(V), row) for row in rows])
    return roots + kids, [-1, -1, 0, 1], q


def run(scheme: str, P: torch.Tensor, Q: torch.Tensor, n_trials: int, seed: int) -> "np.ndarray":
    import numpy as np

    gen = torch.Generator().manual_seed(seed)
    logP = P.clamp_min(1e-30).log()
    outs: list[list[int]] = [[] for _ in range(n_trials)]
    rnd = 0
    while True:
        live = [t for t in range(n_trials) if len(outs[t]) < N_TOKENS]
        if not live:
            break
        works, logits = [], []
        for t in live:
            prev = outs[t][-1] if outs[t] else START
            tokens, parents, q = tree_for(scheme, prev, Q, gen)
            works.append(VerifyWork.create("s", 0, 0, [prev], tokens, q, PARAMS, mix64(seed * 1_000_003 + t * 101 + rnd),
                                           parents=parents, scheme=scheme))
            logits.append(logP[[prev] + tokens])  # [N + 1, V]: the root's row, then each node's
        for t, w, (path, nxt) in zip(live, works, _verify_trees(works, logits, V)):
            outs[t].extend([w.drafts[i] for i in path] + [nxt])
        rnd += 1
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for out in outs:
        counts[tuple(out[:N_TOKENS])] += 1
    return counts


@pytest.mark.parametrize("scheme", [CANDIDATES, IID, WITHOUT_REPLACEMENT])
def test_tree_verification_in_the_engine_matches_the_target(scheme):
    P, Q = make_tables(PARAMS)
    assert_matches_target(run(scheme, P, Q, N_TRIALS, seed=11), exact_joint(P))


def test_candidates_with_one_noise_for_every_level_are_detected(monkeypatch):
    """Negative control: the same noise at every level (levels not independent) is not the target's law."""
    monkeypatch.setattr(verify, "derive_seed", lambda seed, level, stream: seed)
    P, Q = make_tables(PARAMS)
    pvalue, _, _ = goodness_of_fit(run(CANDIDATES, P, Q, 2000, seed=12), exact_joint(P))
    assert pvalue < 1e-6, pvalue
