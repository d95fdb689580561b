"""Exact cases for prompt lookup and the adaptive-K controller."""

import pytest

from coordinator.adaptive import AdaptiveConfig, AdaptiveK, LinearCost, expected_tokens
from coordinator.lookup import LookupConfig, NgramIndex


def test_lookup_continues_latest_earlier_match_of_longest_suffix():
    idx = NgramIndex(LookupConfig(min_ngram=1, max_ngram=3), [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # suffix (6, 7): latest earlier occurrence ends at 8 -> continuation 2, 3, 6, 7
    assert idx.propose(2) == [2, 3]
    assert idx.propose(10) == [2, 3, 6, 7]
    idx.extend([2])
    # suffix (6, 7, 2) matched at length 3 -> continuation 3, 6, 7, 2
    assert idx.propose(3) == [3, 6, 7]


def test_lookup_prefers_longer_ngrams_and_respects_min():
    tokens = [1, 2, 3, 9, 4, 2, 3, 8, 4, 2, 3]
    # 3-gram (4, 2, 3) last seen ending at 7 -> [8, ...]; the 2-gram alone would give the same here
    assert NgramIndex(LookupConfig(1, 3), tokens).propose(1) == [8]
    # with only 2-grams: (2, 3) latest earlier ends at 7 -> 8
    assert NgramIndex(LookupConfig(2, 2), tokens).propose(2) == [8, 4]
    # min_ngram 2: a suffix whose 2-gram never occurred before gives nothing
    assert NgramIndex(LookupConfig(2, 4), [1, 2, 3, 4]).propose(3) == []
    assert NgramIndex(LookupConfig(1, 4), [1, 2, 3, 1]).propose(3) == [2, 3, 1]


def test_lookup_never_matches_the_suffix_itself_and_handles_short_sequences():
    assert NgramIndex(LookupConfig(1, 3), []).propose(4) == []
    assert NgramIndex(LookupConfig(1, 3), [7]).propose(4) == []
    assert NgramIndex(LookupConfig(1, 3), [7, 7]).propose(4) == [7]  # 1-gram (7,) earlier at 0 -> [7]
    assert NgramIndex(LookupConfig(1, 3), [1, 2]).propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex(LookupConfig(3, 2))


def test_lookup_incremental_equals_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(LookupConfig(1, 3), seq[:5])
    for i in range(5, len(seq)):
        grown.extend([seq[i]])
        assert grown.propose(4) == NgramIndex(LookupConfig(1, 3), seq[: i + 1]).propose(4)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_linear_cost_recovers_a_line():
    cost = LinearCost(decay=0.95, prior_intercept=100.0, prior_slope=0.0)
    for _ in range(30):
        for k in (1, 3, 6):
            cost.observe(k, 40.0 + 5.0 * k)
    assert cost.predict(0) == pytest.approx(40.0, rel=0.1)
    assert cost.predict(8) == pytest.approx(80.0, rel=0.1)


def _drive(ctrl: AdaptiveK, acceptance: float, draft_ms_per_token: float, verify_ms: float, rounds: int = 60) -> list[int]:
    ks = []
    for _ in range(rounds):
        k = ctrl.choose()
        ks.append(k)
        n = round(k * acceptance)  # deterministic stand-in for a round with this acceptance
        ctrl.observe(k, n, 1.0 + draft_ms_per_token * k if k else 0.0, verify_ms * (1 + 0.05 * k))
    return ks


def test_adaptive_k_grows_when_drafts_are_accepted_and_cheap():
    ks = _drive(AdaptiveK(AdaptiveConfig(max_k=8), local_proposer=True), acceptance=1.0, draft_ms_per_token=0.0, verify_ms=50)
    assert ks[-10:] == [8] * 10


def test_adaptive_k_turns_speculation_off_when_it_cannot_pay_and_keeps_probing():
    ks = _drive(AdaptiveK(AdaptiveConfig(max_k=8, probe_every=8), local_proposer=False), acceptance=0.0,
                draft_ms_per_token=8.0, verify_ms=50)
    tail = ks[-32:]
    assert tail.count(0) >= 24  # mostly target-only
    assert 1 in tail  # but still probing
