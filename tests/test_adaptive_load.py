"""Adaptive K that knows the load: exact cases of TierLoad and of the K it leads AdaptiveK to."""

from __future__ import annotations

import pytest

from coordinator.adaptive import AdaptiveConfig, AdaptiveK, TierLoad, expected_tokens


def loaded(sessions: int, alpha: float = 40.0, beta: float = 3.0, overhead: float = 2.0, rounds: int = 60) -> TierLoad:
    """A TierLoad fed steps of a tier whose step time is alpha + beta * tokens."""
    load = TierLoad()
    for i in range(rounds):
        tokens = sessions * (1 + i % 5)  # the sessions' K varied 0..4
        load.observe(sessions, tokens, alpha + beta * tokens, alpha + beta * tokens + overhead)
    return load


def test_tier_load_learns_the_step_cost_line_and_the_batch():
    load = loaded(8)
    assert load.sessions == pytest.approx(8.0)
    assert load.overhead_ms == pytest.approx(2.0)
    assert load.step_cost.predict(0) == pytest.approx(40.0, rel=0.02)
    assert load.step_cost.predict(100) == pytest.approx(340.0, rel=0.02)
    # A round with K drafts when all 8 sessions send K: 8 * (K + 1) tokens in the step.
    assert load.round_ms(3) == pytest.approx(2.0 + 40.0 + 3.0 * 32, rel=0.02)


def test_tier_load_ignores_replies_without_batch_data():
    load = TierLoad()
    load.observe(0, 0, 0.0, 5.0)
    assert load.observations == 0


def controller(load: TierLoad, acceptance_rounds: list[tuple[int, int]]) -> AdaptiveK:
    c = AdaptiveK(AdaptiveConfig(max_k=8), local_proposer=True, load=load)
    for k, n in acceptance_rounds:
        c.observe(k, n, propose_ms=0.0, verify_ms=50.0)
    return c


def best_k(a: float, sessions: int, alpha: float, beta: float) -> int:
    """The K maximising expected tokens per unit of step time when every session sends K."""
    return max(range(9), key=lambda k: expected_tokens(a, k) / (2.0 + alpha + beta * sessions * (k + 1)))


@pytest.mark.parametrize("sessions", [1, 4, 16, 32])
def test_k_follows_the_aggregate_optimum_at_each_batch_size(sessions):
    history = [(4, 3)] * 40  # acceptance 0.75
    c = controller(loaded(sessions), history)
    assert c.choose() == best_k(c.acceptance, sessions, 40.0, 3.0)


def test_k_falls_as_the_batch_grows():
    history = [(4, 3)] * 40
    ks = [controller(loaded(b), history).choose() for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_without_load_data_the_sessions_own_fit_decides():
    c = AdaptiveK(AdaptiveConfig(max_k=8), local_proposer=True, load=TierLoad())
    alone = AdaptiveK(AdaptiveConfig(max_k=8), local_proposer=True)
    for _ in range(30):
        for ctl in (c, alone):
            ctl.observe(4, 4, propose_ms=0.0, verify_ms=30.0)
    assert c.choose() == alone.choose()
