"""Adaptive K that knows the load: exact cases of TierLoad and of the K it leads the policy to."""

from __future__ import annotations

import pytest

from coordinator.proposers.adaptive import AdaptiveConfig, TierLoad, expected_tokens
from coordinator.proposers.policy import ProposerPolicy
from coordinator.proposers.base import Proposal
from coordinator.proposers.names import PROMPT_LOOKUP


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
    # A round with K drafts when all 8 sessions send K: its share of a step of 8 * (K + 1) tokens.
    assert load.round_ms(3) == pytest.approx(2.0 + (40.0 + 3.0 * 32) / 8, rel=0.02)
    v0, v1 = load.verify_line()
    assert (v0, v1) == pytest.approx((2.0 + 40.0 / 8 + 3.0, 3.0), rel=0.02)


def test_queueing_is_not_charged_the_calls_own_overhead_is():
    load = TierLoad()
    for queued in [0.0, 150.0, 1.0, 400.0, 0.5, 90.0] * 10:  # calls that queued behind others now and then
        load.observe(8, 16, 50.0, 50.0 + queued + 2.0, compute_ms=50.0, queue_ms=queued)
    assert load.overhead_ms == pytest.approx(2.0)


def test_tier_load_ignores_replies_without_batch_data():
    load = TierLoad()
    load.observe(0, 0, 0.0, 5.0)
    assert load.observations == 0


def policy(load: TierLoad | None, rounds: int = 40, accepted: int = 3) -> ProposerPolicy:
    """A lookup-only session policy that has seen `rounds` rounds of 4 drafts with `accepted` accepted."""
    pol = ProposerPolicy(AdaptiveConfig(max_k=8), (PROMPT_LOOKUP,), load=load)
    for _ in range(rounds):
        pol.observe(Proposal(PROMPT_LOOKUP, [7] * 4), 4, accepted, verify_ms=50.0)
    return pol


OFFER = [Proposal(PROMPT_LOOKUP, list(range(100, 108)))]  # lookup offers an 8-token chain


def chosen_k(pol: ProposerPolicy) -> int:
    return pol.choose(OFFER, max_k=8, draft=False, fixed=False).k


def best_k(a: float, sessions: int, alpha: float, beta: float) -> int:
    """The K maximising expected tokens per unit of the tier's time when every session sends K."""
    return max(range(9), key=lambda k: expected_tokens(a, k) / (2.0 + (alpha + beta * sessions * (k + 1)) / sessions))


@pytest.mark.parametrize("sessions", [1, 4, 16])
def test_k_follows_the_aggregate_optimum_at_each_batch_size(sessions):
    pol = policy(loaded(sessions))  # acceptance 0.75
    a = pol.estimates[PROMPT_LOOKUP].acceptance
    want = best_k(a, sessions, 40.0, 3.0)
    assert want > 0
    assert chosen_k(pol) == want


def test_k_falls_as_the_batch_grows_and_speculation_stops_when_it_no_longer_pays():
    ks = [chosen_k(policy(loaded(b, alpha=80.0, beta=6.0), accepted=1)) for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    # acceptance ~0.25 with 64 sessions a step: no K beats target-only (probing aside)
    assert best_k(policy(None, accepted=1).estimates[PROMPT_LOOKUP].acceptance, 64, 80.0, 6.0) == 0
    assert ks[-1] == 0


def test_without_load_data_the_sessions_own_fit_decides():
    assert chosen_k(policy(TierLoad())) == chosen_k(policy(None))


def test_a_negative_draft_session_limit_is_refused_at_start(capsys):
    from coordinator.__main__ import main

    with pytest.raises(SystemExit) as e:  # before connecting to anything
        main(["--draft-max-sessions", "-1"])
    assert e.value.code == 2 and "--draft-max-sessions must be >= 0" in capsys.readouterr().err
