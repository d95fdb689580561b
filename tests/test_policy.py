"""The policy (coordinator.proposers.policy) decision by decision: fake strategies with set predictions, the
real strategies over fake tiers, and the round loop with a fake target (tests/test_round_loop.py's fakes).

What it must do (DESIGN.md, "Proposers"): pick the prediction of most tokens per ms, K = 0 included, drafting
only where that beats K = 0 by min_gain; probe a K = 1 every probe_every rounds when K = 0 wins, unless that
K = 1's strategy judges itself for free; honour a request's K; and in a cold burst (sessions starting
together, none finished) price every proposal from the cost curve the target measured at start, at the
batch it is running now, so that a steep curve at batch 16 means K = 0 from the first round."""

from __future__ import annotations

import pytest

from coordinator.proposers.base import Proposal
from specdec.core.proposer_names import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX
from coordinator.proposers.policy import Policy, PolicyConfig, restart_ms
from coordinator.proposers.strategy import Prediction, Strategy
from coordinator.proposers.tier_cost import TierCost
from tests.proposer_fakes import Offer, ask, draft, status
from tests.test_round_loop import FakeDraft, FakeTarget, generation, run, tokens, truth


class Fixed:
    """A strategy whose predictions are set by hand: (k, tokens, cost_ms) each."""

    def __init__(self, source: str, shapes, judged_unchosen: bool = False) -> None:
        self.source, self.shapes, self.judged_unchosen, self.asked = source, shapes, judged_unchosen, 0

    def predict(self, ask) -> list[Prediction]:
        self.asked += 1
        return [Prediction(self, k, e, c) for k, e, c in self.shapes if k <= ask.k and (not ask.fixed or k == ask.k)]


def chosen(choice: Prediction | None) -> tuple[str, int] | None:
    return None if choice is None else (choice.by.source, choice.k)


def test_the_largest_rate_wins_and_k0_counts():
    """verify(0) = 53 ms with nothing measured: K = 0 yields 1/53 = 0.0189 tokens a ms."""
    a = Fixed(PROMPT_LOOKUP, [(1, 1.5, 56.0), (2, 1.9, 60.0)])  # 0.0268, 0.0317
    b = Fixed(DRAFT_MODEL, [(1, 1.8, 62.0), (3, 2.6, 80.0)])  # 0.0290, 0.0325
    assert chosen(Policy(PolicyConfig()).choose([a, b], ask())) == (DRAFT_MODEL, 3)
    assert chosen(Policy(PolicyConfig()).choose([a], ask())) == (PROMPT_LOOKUP, 2)
    slow = Fixed(DRAFT_MODEL, [(1, 1.8, 120.0)])  # 0.015 < 0.0189
    assert Policy(PolicyConfig()).choose([slow], ask()) is None
    assert Policy(PolicyConfig()).choose([Fixed(SUFFIX, [])], ask()) is None  # nothing offered: K = 0


def test_drafting_must_beat_k0_by_the_margin():
    """1.04x K = 0's rate is not enough at min_gain 1.05; 1.06x is."""
    k0 = 1 / 53.0
    assert Policy(PolicyConfig()).choose([Fixed(SUFFIX, [(1, 1.04 * k0 * 50, 50.0)])], ask()) is None
    assert chosen(Policy(PolicyConfig()).choose([Fixed(SUFFIX, [(1, 1.06 * k0 * 50, 50.0)])], ask())) == (SUFFIX, 1)
    assert chosen(Policy(PolicyConfig(min_gain=1.0)).choose([Fixed(SUFFIX, [(1, 1.04 * k0 * 50, 50.0)])], ask())) == (SUFFIX, 1)


def test_k0_is_priced_with_the_tokens_its_target_would_run_on_for():
    """verify(0) = 53 ms, a step 10 ms: K = 0 running on for 7 tokens yields 8 / (53 + 70) = 0.065 tokens a ms,
    more than a proposal of 2.6 tokens in 80 ms (0.0325), which beats K = 0 without a run-on (1 / 53 = 0.0189)."""
    from dataclasses import replace

    b = Fixed(DRAFT_MODEL, [(3, 2.6, 80.0)])
    assert chosen(Policy(PolicyConfig()).choose([b], replace(ask(), run_on=0, step_ms=10.0))) == (DRAFT_MODEL, 3)
    assert Policy(PolicyConfig()).choose([b], replace(ask(), run_on=7, step_ms=10.0)) is None
    assert chosen(Policy(PolicyConfig()).choose([b], replace(ask(), run_on=7, step_ms=60.0))) == (DRAFT_MODEL, 3)  # 8/473


def test_restart_ms_counts_the_ramps_rounds_over_again():
    """After s target-only rounds the run-on has climbed 0, 1, 3, 7 (cap 8): drafting now means climbing again,
    s rounds for 2^s - 1 tokens where level s commits r_s + 1 a round, so (s - T / (r_s + 1)) rounds' fixed time."""
    assert restart_ms(0, 8, 10.0) == 0.0  # the last round drafted: the ramp is at its foot already
    assert restart_ms(1, 8, 10.0) == pytest.approx(5.0)  # 1 round for 1 token, where level 1 commits 2 a round
    assert restart_ms(3, 8, 10.0) == pytest.approx(10.0 * (3 - 7 / 8))
    assert restart_ms(4, 8, 10.0) == pytest.approx(10.0 * (4 - 15 / 9)) == restart_ms(40, 8, 10.0)  # at the cap
    assert restart_ms(4, 0, 10.0) == 0.0 and restart_ms(4, 8, -3.0) == 0.0  # no run-on; no fixed time


def test_a_drafting_round_after_a_streak_runs_on_or_is_charged_the_ramp_it_starts_over():
    """verify(0) = 53 ms, a step 23 ms (a round's fixed time 30 ms), run-on cap 8: K = 0 yields 9 / 237 tokens a
    ms (0.0380; x 1.05: 0.0399). A chain of 2.6 tokens in 60 ms wins right after a drafting round (2.6 / 60, the
    ramp at its foot: no run-on). After a streak it either starts the ramp over (70 ms more after 4 rounds:
    2.6 / 130, which lost 11% to K = 0 through the OpenAI API at 4 streams) or runs on as this round's K = 0
    would, the ramp going on: after 4 rounds 8 tokens, 10.6 / 244 = 0.0434, after one 1 token, 3.6 / 83: it wins
    running on. A chain of 1.3 tokens in 60 ms loses either way (9.3 / 244 = 0.0381)."""
    from dataclasses import replace

    def pick(shapes, streak, fixed=False):
        choice = Policy(PolicyConfig()).choose([Fixed(SUFFIX, shapes)], replace(
            ask(k=3 if fixed else 8, fixed=fixed), run_on=8, step_ms=23.0, streak=streak))
        return None if choice is None else (choice.by.source, choice.k, choice.run_on)

    assert pick([(3, 2.6, 60.0)], streak=0) == (SUFFIX, 3, 0)
    assert pick([(3, 2.6, 60.0)], streak=4) == (SUFFIX, 3, 8) and pick([(3, 2.6, 60.0)], streak=1) == (SUFFIX, 3, 1)
    assert pick([(3, 1.3, 60.0)], streak=4) is None and pick([(3, 1.3, 60.0)], streak=0) is None
    assert pick([(3, 2.6, 60.0), (8, 6.0, 70.0)], streak=4) == (SUFFIX, 8, 8)
    assert pick([(3, 2.6, 60.0)], streak=4, fixed=True) == (SUFFIX, 3, 0)  # a request's own K: no K = 0, no ramp
    # With the run-on off nothing runs on, and the ramp's charge is zero
    assert Policy(PolicyConfig()).choose([Fixed(SUFFIX, [(3, 2.6, 60.0)])], replace(
        ask(k=8), run_on=0, step_ms=23.0, streak=4)).run_on == 0


def test_the_drafter_tells_the_policy_its_streak():
    """Ask.streak: the target-only rounds in a row before the round (a probe keeps the streak; a draft ends it)."""
    cont = truth()
    seen = []

    class Watching(Strategy):
        source = SUFFIX

        def predict(self, ask):
            seen.append(ask.streak)
            return []

        def observe(self, outcome):
            pass

    target, tier = FakeTarget(cont), FakeDraft(cont)
    gen = generation(target, tier, k=None, max_new=6, load=measured(1))
    gen.drafter.strategies = [Watching()]
    chunks, _ = run(gen)
    assert tokens(chunks) == cont[:6] and seen[:3] == [0, 1, 2]


def test_k0_rounds_probe_a_k1_unless_its_strategy_judges_itself_for_free():
    """(A budget of all the time: the schedule alone decides.)"""
    losing = [(1, 1.1, 100.0)]
    policy = Policy(PolicyConfig(probe_every=4, probe_budget=1.0))
    picks = [chosen(policy.choose([Fixed(DRAFT_MODEL, losing)], ask())) for _ in range(12)]
    assert picks == [None, None, None, (DRAFT_MODEL, 1)] + [None] * 7 + [(DRAFT_MODEL, 1)]  # then twice as long
    free = Policy(PolicyConfig(probe_every=4, probe_budget=1.0))
    assert [free.choose([Fixed(PROMPT_LOOKUP, losing, judged_unchosen=True)], ask()) for _ in range(8)] == [None] * 8


def test_a_probe_waits_until_the_budget_covers_its_loss():
    """K = 0 rounds of 53 ms; a K = 1 of 1.1 tokens in 100 ms loses 100 - 1.1 x 53 = 41.7 ms against them. At
    probe_budget 0.02 each K = 0 round earns 1.06 ms: the probe waits for the 40th round, not the 4th, and the
    next, twice the interval later, for 40 rounds more. A probe losing nothing goes on the schedule's turn."""
    losing = [(1, 1.1, 100.0)]
    policy = Policy(PolicyConfig(probe_every=4, probe_budget=0.02))
    picks = [chosen(policy.choose([Fixed(DRAFT_MODEL, losing)], ask())) for _ in range(80)]
    assert [i for i, p in enumerate(picks) if p] == [39, 79]
    assert all(p in (None, (DRAFT_MODEL, 1)) for p in picks)
    cheap = [(1, 1.0, 53.0)]  # the same tokens in the same time as K = 0 (not the margin's 1.05x, so a probe)
    policy = Policy(PolicyConfig(probe_every=4, probe_budget=0.02))
    picks = [chosen(policy.choose([Fixed(DRAFT_MODEL, cheap)], ask())) for _ in range(12)]
    assert [i for i, p in enumerate(picks) if p] == [3, 11]
    with pytest.raises(ValueError, match="probe_budget"):
        PolicyConfig(probe_budget=1.5)


def test_a_draft_that_sat_out_rounds_is_priced_with_feeding_them():
    """The draft tier timed prefills of 16 and 64 tokens at start (StatusResponse.feed_cost): 1.8 and 4.2 ms,
    0.05 ms a token fed. A draft holding 98 of 100 committed tokens (it drafted last round) is priced at its steps
    alone; one holding none (a cold start, or rounds of K = 0) also feeds the 100 with its first step: 5 ms more
    on every shape it offers."""
    from dataclasses import replace

    from specdec.proto import common_pb2

    cost, reported = TierCost(), status(lambda n, b: 2.0 + 0.5 * n)
    reported.feed_cost.extend([common_pb2.StepCost(sessions=1, tokens=64, ms=4.2),
                               common_pb2.StepCost(sessions=1, tokens=16, ms=1.8)])
    cost.seed(reported)
    strategy = draft(cost=cost)
    at = replace(ask(k=3), context=100)

    def costs(cached: int, a=at) -> list[float]:
        strategy.session.cached = cached
        return [p.cost_ms for p in strategy.predict(a)]

    following, cold = costs(98), costs(0)
    assert len(cold) == 3 and [c - f for c, f in zip(cold, following)] == pytest.approx([5.0] * 3, abs=1e-6)


def test_a_requests_k_is_honoured_and_a_zero_budget_asks_nobody():
    slow = Fixed(PROMPT_LOOKUP, [(2, 1.1, 500.0), (3, 1.2, 500.0)])
    assert chosen(Policy(PolicyConfig()).choose([slow], ask(k=3, fixed=True))) == (PROMPT_LOOKUP, 3)  # no K = 0 option
    assert chosen(Policy(PolicyConfig()).choose([slow], ask(k=2, fixed=True))) == (PROMPT_LOOKUP, 2)
    assert Policy(PolicyConfig()).choose([slow], ask(k=0)) is None and slow.asked == 2


def hinge(n: float, sessions: float = 1) -> float:
    """A 2-core CPU's target step: flat at 22 ms while streaming the weights bounds it (up to 5 tokens), then
    2.4 ms a token, and 1 ms a session."""
    return 22.0 + 2.4 * max(n - 5.0, 0.0) + 1.0 * (sessions - 1)


def measured(live: int) -> TierCost:
    """A target that reported the hinge as its cost curve at start, with `live` sessions open on it and none of
    their steps reported yet (a cold burst)."""
    cost = TierCost()
    cost.seed(status(hinge), max_sessions=64)
    cost.live = live
    return cost


def test_a_measured_curve_prices_the_batch_the_tier_runs_now():
    one, burst = measured(1), measured(16)
    assert one.batch == 1 and burst.batch == 16
    assert one.verify_ms(3)[0] == pytest.approx(22.0, rel=0.05) and one.verify_ms(3)[3] == pytest.approx(22.0, rel=0.1)  # the fit rounds the corner
    assert burst.verify_ms(3)[0] == pytest.approx(hinge(16, 16), rel=0.05)
    assert burst.verify_ms(3)[3] == pytest.approx(hinge(64, 16), rel=0.05)  # every session of the step sends 3
    capped = measured(100)
    assert capped.batch == 64  # no more than the tier batches


@pytest.mark.parametrize("live, drafts", [(1, True), (16, False), (32, False)])
def test_cold_burst_k0_from_the_first_round_at_batch_16(live, drafts):
    """No session has finished (priors at 0.5, no step reported): at batch 1 the flat curve makes drafting pay
    (a verify of 5 costs one step), at 16 and 32 sessions each draft token adds 16-32 x 2.4 ms to a step
    every session waits for, so no strategy's first proposal beats K = 0."""
    lookup = Offer(PROMPT_LOOKUP)
    lookup.next = Proposal(PROMPT_LOOKUP, [5, 6, 7, 8, 9, 10, 11, 12])
    suffix = Offer(SUFFIX)
    suffix.next = Proposal(SUFFIX, [5, 6, 7, 8], probs=[0.6, 0.4, 0.3, 0.2])
    choice = Policy(PolicyConfig()).choose([suffix, lookup, draft()], ask(measured(live)))
    assert (choice is not None) == drafts


def test_cold_burst_through_the_round_loop():
    """Sixteen sessions open on a target whose curve is steep at batch 16: a session's very first round is the
    target alone (the draft is not asked); with one session open it drafts from the first round."""
    cont = truth()
    for live, first in ((16, []), (1, cont[:4])):
        target, tier = FakeTarget(cont), FakeDraft(cont)
        chunks, _ = run(generation(target, tier, k=None, max_new=8, load=measured(live)))
        assert tokens(chunks) == cont[:8] and target.calls[0] == first[: len(target.calls[0])]
        assert (tier.proposed > 0) == (live == 1) and (len(target.calls[0]) > 0) == (live == 1)


def test_the_curve_is_refined_by_the_steps_reported():
    """A tier that measured a flat curve but, under a burst, reports steep steps: the policy follows the steps."""
    cost = TierCost()
    cost.seed(status(lambda n, b: 22.0), max_sessions=64)
    cost.live = 16
    lookup = Offer(PROMPT_LOOKUP)
    lookup.next = Proposal(PROMPT_LOOKUP, [5, 6, 7, 8])
    assert Policy(PolicyConfig()).choose([lookup], ask(cost)) is not None  # priced flat: drafts
    for i in range(60):
        n = 16 * (1 + i % 5)
        cost.observe(16, n, hinge(n, 16), hinge(n, 16) + 1.0)
    assert Policy(PolicyConfig()).choose([lookup], ask(cost)) is None
