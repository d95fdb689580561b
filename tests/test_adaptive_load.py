"""Adaptive K that knows the load: exact cases of TierCost (coordinator.proposers.tier_cost) and of the K it
leads the policy to."""

from __future__ import annotations

import pytest

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import LinearCost, SharedPriors, expected_tokens
from specdec.core.proposer_names import PROMPT_LOOKUP
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.tier_cost import StepCurve, TierCost
from tests.proposer_fakes import Offer, ask, draft


def loaded(sessions: int, alpha: float = 40.0, beta: float = 3.0, overhead: float = 2.0, rounds: int = 60,
           step=None, max_k: int = 4) -> TierCost:
    """A TierCost fed steps of a tier whose step time is alpha + beta * tokens (or step(tokens)), the
    sessions' K varied 0..max_k."""
    step = step or (lambda n: alpha + beta * n)
    load = TierCost()
    for i in range(rounds):
        tokens = sessions * (1 + i % (max_k + 1))
        load.observe(sessions, tokens, step(tokens), step(tokens) + overhead)
    return load


def test_tier_load_learns_the_step_cost_line_and_the_batch():
    load = loaded(8)
    assert load.sessions == pytest.approx(8.0)
    assert load.overhead.predict(0) == pytest.approx(2.0)
    assert load.step_cost.predict(1) == pytest.approx(43.0, rel=0.02)
    assert load.step_cost.predict(100) == pytest.approx(340.0, rel=0.02)
    # A round with K drafts when all 8 sessions send K: the call's overhead and a step of 8 * (K + 1) tokens.
    assert load.verify_ms(3)[3] == pytest.approx(2.0 + 40.0 + 3.0 * 32, rel=0.02)
    assert load.verify_ms(3)[0] == pytest.approx(2.0 + 40.0 + 3.0 * 8, rel=0.02)


def hinge(n: float) -> float:
    """A CPU-like step: flat at 22 ms while the weights' streaming bounds it (up to 5 tokens), then 2.4 ms a token."""
    return 22.0 + 2.4 * max(n - 5.0, 0.0)


def test_the_step_curve_follows_a_flat_then_steep_step_where_a_line_cannot():
    curve, line = StepCurve(), LinearCost(0.98)
    for _ in range(20):
        for n in (1, 2, 3, 4, 6, 9, 12, 16, 24, 32, 40, 48):  # a batch ramping up and down
            curve.observe(n, hinge(n))
            line.observe(n, hinge(n))
    for n in (1, 3, 16, 20, 44, 48, 64):
        assert curve.predict(n) == pytest.approx(hinge(n), rel=0.08), n
    # The slope at a 16-session batch's size is the marginal cost of a token there.
    slope = (curve.predict(48) - curve.predict(16)) / 32
    assert slope == pytest.approx(2.4, rel=0.03)
    assert abs(line.predict(1) - hinge(1)) > 0.2 * hinge(1)  # a line cannot be flat and steep


def test_the_step_curve_reads_the_prior_slope_from_one_size_and_never_slopes_down():
    curve = StepCurve(prior_intercept=50.0, prior_slope=3.0)
    assert curve.predict(10) == pytest.approx(80.0)  # no step seen: the prior line
    for _ in range(20):
        curve.observe(16, 60.0)
    assert curve.predict(16) == pytest.approx(60.0)
    assert curve.predict(20) == pytest.approx(72.0)  # one size seen: the prior's slope through it
    for _ in range(20):
        curve.observe(24, 50.0)  # bigger steps that happened to be faster (noise): no line downhill from them
    assert all(50.0 <= curve.predict(n) <= 60.0 for n in (8, 16, 20, 24, 40, 100))
    load = TierCost()
    load.step_cost, load.sessions = curve, 8.0
    costs = load.verify_ms(8)
    assert costs == sorted(costs)  # the policy's verify times never fall with K


def test_the_step_curve_tells_sessions_from_tokens():
    """One session verifying up to 9 tokens costs a flat ~22 ms (CPU-like); four sessions' steps cost 23 ms
    plus 1.4 ms for each token past 4. The curve at 8 tokens in 4 sessions is the 4 sessions' cost, not the
    single session's flat line, whichever came last."""
    def single(n):
        return 22.0

    def four(n):
        return 23.0 + 1.4 * (n - 4)

    for order in ("single first", "four first"):
        curve = StepCurve()
        batches = [(1, range(1, 10), single), (4, range(4, 17, 2), four)]
        for sessions, sizes, cost in batches if order == "single first" else batches[::-1]:
            for _ in range(8):
                for n in sizes:
                    curve.observe(n, cost(n), sessions)
        assert curve.predict(8, 4) == pytest.approx(four(8), rel=0.05), order
        assert curve.predict(8, 1) == pytest.approx(22.0, rel=0.05), order


def test_the_step_curve_forgets_old_steps():
    curve = StepCurve(window=64)
    for _ in range(64):
        curve.observe(16, 100.0)  # a slower past (longer contexts, another process on the cores)
    for _ in range(64):
        curve.observe(16, 60.0)
    assert curve.predict(16) == pytest.approx(60.0)


def test_a_step_reported_by_each_of_its_sessions_counts_once():
    """A step of 32 sessions reaches the coordinator in 32 replies with one step id: the curve counts it once, so
    its window and its refits span the same steps as at one session (without ids, 64 slow steps' reports would
    push 64 fast ones out of a 128-report window and set the price alone)."""
    def fed(ids: bool) -> TierCost:
        load = TierCost()
        for step in range(64):  # an earlier, faster regime: steps of 4 sessions
            for _ in range(4):
                load.observe(4, 4, 20.0, 22.0, step_id=1000 + step if ids else 0)
        for step in range(64):  # then the same tier slower at 32 sessions, each step reported 32 times
            for _ in range(32):
                load.observe(32, 32, 80.0, 82.0, step_id=5000 + step if ids else 0)
        return load

    once, every = fed(ids=True), fed(ids=False)
    assert len(once.step_cost._steps) == 128 and len(every.step_cost._steps) == 128
    assert once.step_cost.predict(4, 4) == pytest.approx(20.0, rel=0.01), "the fast steps are still on the curve"
    assert abs(every.step_cost.predict(4, 4) - 20.0) > 5.0, "without ids the slow steps' reports crowded them out"
    assert once.sessions == pytest.approx(every.sessions), "the batch a call meets is still counted per reply"
    assert once.step_cost.predict(32, 32) == pytest.approx(80.0, rel=0.01)


def test_queueing_is_not_charged_the_calls_own_overhead_is():
    load = TierCost()
    for queued in [0.0, 150.0, 1.0, 400.0, 0.5, 90.0] * 10:  # calls that queued behind others now and then
        load.observe(8, 16, 50.0, 50.0 + queued + 2.0, compute_ms=50.0, queue_ms=queued)
    assert load.overhead.predict(0) == pytest.approx(2.0)
    assert load.wait == 0.0 and load.verify_ms(0)[0] == pytest.approx(2.0 + load.step_cost.predict(8, 8))  # no wait reported


def test_the_wait_for_the_step_in_progress_is_charged_once_a_call_at_most_a_step():
    """A call that arrives while its batch steps waits for that step to end before its own: a round trip's cost
    that a target-only run-on pays once for many tokens. The wait is priced per call; a longer one (behind another
    session's prompt) is capped at a step at the batch, since it stalls every session, running on or not."""
    load = TierCost()
    for i in range(200):
        load.observe(4, 4, 20.0, 20.0 + 8.0 + 2.0, compute_ms=20.0, queue_ms=8.0, wait_ms=8.0, step_id=i + 1)
    assert load.wait == pytest.approx(8.0, rel=0.01)
    assert load.verify_ms(2) == pytest.approx([8.0 + 2.0 + s for s in load.step_cost.predict_many([4, 8, 12], 4)], rel=0.01)
    for i in range(200):  # every call behind a 300 ms prompt: at most one step (20 ms) each
        load.observe(4, 4, 20.0, 20.0 + 300.0 + 2.0, compute_ms=20.0, queue_ms=300.0, wait_ms=300.0, step_id=1000 + i)
    assert load.wait == pytest.approx(20.0, rel=0.02)


def test_a_calls_overhead_grows_with_the_drafts_it_carries():
    """Each draft adds its token and q row to the request and its verdict to the reply: the overhead is a
    line in K, and a round with K drafts is charged the overhead of K."""
    load = TierCost()
    for i in range(60):
        k = i % 5
        load.observe(4, 4 * (k + 1), 30.0, 30.0 + 2.0 + 0.5 * k + 7.0, compute_ms=30.0, queue_ms=7.0, drafts=k)
    assert load.overhead.predict(0) == pytest.approx(2.0, rel=1e-3)
    assert load.overhead.predict(1) - load.overhead.predict(0) == pytest.approx(0.5, rel=1e-3)
    assert load.verify_ms(3)[3] - load.verify_ms(3)[0] == pytest.approx(1.5 + load.step_cost.predict(16, 4) - load.step_cost.predict(4, 4),
                                                                rel=1e-3)


def test_a_reply_without_batch_data_is_a_step_of_its_own():
    """A tier that reports no batching (a fake, an older replica): its call is taken as a step of its drafts + 1
    tokens for one session, so the session's own rounds price the verify."""
    load = TierCost()
    assert load.verify_ms(3) == pytest.approx([53.0, 56.0, 59.0, 62.0])  # nothing measured: the prior curve
    for i in range(40):
        load.observe(0, 0, 0.0, 20.0 + 2.0 * (i % 4), drafts=i % 4)
    assert load.observations == 40 and load.sessions == 1.0
    assert load.verify_ms(3) == pytest.approx([20.0, 22.0, 24.0, 26.0], rel=0.02)


def lookup(load: TierCost | None, rounds: int = 40, accepted: int = 3) -> tuple[Offer, TierCost]:
    """A lookup strategy that has seen `rounds` rounds of 4 drafts with `accepted` accepted, offering an 8-token chain."""
    s = Offer(PROMPT_LOOKUP)
    s.next = Proposal(PROMPT_LOOKUP, list(range(100, 108)))
    for _ in range(rounds):
        s.acceptance.judge(4, accepted)
    return s, load or TierCost()


def chosen_k(strategy: tuple[Offer, TierCost]) -> int:
    choice = Policy(PolicyConfig(max_k=8)).choose([strategy[0]], ask(strategy[1]))
    return 0 if choice is None else choice.k


def best_k(a: float, sessions: int, alpha: float, beta: float, step=None) -> int:
    """The K maximising the tier's tokens per unit of time when every session sends K: B E(K) tokens per
    round of the call's overhead (2 ms) and a step of B (K + 1) tokens."""
    step = step or (lambda n: alpha + beta * n)
    return max(range(9), key=lambda k: sessions * expected_tokens(a, k) / (2.0 + step(sessions * (k + 1))))


@pytest.mark.parametrize("sessions", [1, 4, 16])
def test_k_follows_the_aggregate_optimum_at_each_batch_size(sessions):
    s = lookup(loaded(sessions))  # acceptance 0.75
    want = best_k(s[0].acceptance.value, sessions, 40.0, 3.0)
    assert want > 0
    assert chosen_k(s) == want


def test_k_falls_as_the_batch_grows_and_speculation_stops_when_it_no_longer_pays():
    ks = [chosen_k(lookup(loaded(b, alpha=80.0, beta=6.0), accepted=1)) for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    # acceptance ~0.25 with 64 sessions a step: no K beats target-only
    assert best_k(lookup(None, accepted=1)[0].acceptance.value, 64, 80.0, 6.0) == 0
    assert ks[-1] == 0


@pytest.mark.parametrize("sessions", [1, 16])
def test_on_a_flat_then_steep_step_k_is_the_aggregate_optimum(sessions):
    """One session: a verify of up to 5 tokens costs one step, so it drafts deep; sixteen sessions on the
    steep part of the curve: a draft token accepted half the time does not pay for the 2.4 ms it
    adds to a step every session waits for (a linear fit over the same steps drafted there)."""
    s = lookup(loaded(sessions, step=hinge, rounds=100, max_k=8), accepted=1)  # acceptance ~0.5
    a = s[0].acceptance.value
    want = best_k(a, sessions, 0.0, 0.0, step=hinge)
    assert (want > 0) == (sessions == 1)
    k = chosen_k(s)
    assert (k > 0) == (want > 0)

    def rate(k: int) -> float:  # the tier's tokens per ms when every session sends k
        return sessions * expected_tokens(a, k) / (2.0 + hinge(sessions * (k + 1)))

    assert rate(k) >= 0.95 * rate(want)  # the fit rounds the curve's corner: a K as good, if not the same


def test_no_session_probes_a_local_chain_it_judges_for_free():
    """K = 0 wins: a session's local chains are judged against the committed tokens every round, greedy or
    sampled (a one-hot draft matched has its acceptance's law), so no round spends a verify row probing them;
    the draft model, which is not judged so, is probed: one K = 1 after probe_every rounds, then after twice
    as many while K = 0 keeps winning, greedy or sampled (a budget of all the time: the schedule alone decides)."""
    def ks(greedy: bool, with_draft: bool) -> list[int]:
        policy, load = Policy(PolicyConfig(max_k=8, probe_every=4, probe_budget=1.0)), loaded(16, step=hinge)
        strategy = draft(greedy=greedy) if with_draft else lookup(None, rounds=20, accepted=0)[0]
        strategy.greedy = greedy
        for _ in range(20):
            strategy.acceptance.judge(4, 0)  # nothing accepted lately
        return [(c.k if (c := policy.choose([strategy], ask(load))) else 0) for _ in range(32)]

    backing_off = [0, 0, 0, 1] + [0] * 7 + [1] + [0] * 15 + [1] + [0] * 4  # after 4, 8, then 16 rounds
    assert ks(greedy=True, with_draft=False) == [0] * 32
    assert ks(greedy=False, with_draft=False) == [0] * 32
    assert ks(greedy=True, with_draft=True) == backing_off
    assert ks(greedy=False, with_draft=True) == backing_off


def test_probing_returns_to_its_first_interval_once_drafting_wins():
    policy, load = Policy(PolicyConfig(max_k=8, probe_every=2, probe_max_every=8, probe_budget=1.0)), loaded(16, step=hinge)
    strategy = draft(greedy=True)
    for _ in range(20):
        strategy.acceptance.judge(4, 0)
    first = [(c.k if (c := policy.choose([strategy], ask(load))) else 0) for _ in range(14)]
    assert first == [0, 1, 0, 0, 0, 1] + [0] * 7 + [1]  # after 2, 4, then 8 rounds (the cap)
    for _ in range(50):
        strategy.acceptance.judge(4, 4)  # everything accepted: drafting wins
    assert policy.choose([strategy], ask(load)).k > 1
    for _ in range(50):
        strategy.acceptance.judge(4, 0)
    again = [(c.k if (c := policy.choose([strategy], ask(load))) else 0) for _ in range(6)]
    assert again == [0, 1, 0, 0, 0, 1]


def test_a_margin_below_one_is_refused_at_start(capsys):
    from coordinator.__main__ import main

    with pytest.raises(SystemExit) as e:  # before connecting to anything
        main(["--adaptive-min-gain", "0.9"])
    assert e.value.code == 2 and "--adaptive-min-gain must be >= 1" in capsys.readouterr().err


def test_a_negative_draft_session_limit_is_refused_at_start(capsys):
    from coordinator.__main__ import main

    with pytest.raises(SystemExit) as e:  # before connecting to anything
        main(["--draft-max-sessions", "-1"])
    assert e.value.code == 2 and "--draft-max-sessions must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("acceptance, drafts", [(0.09, False), (0.2, True)])
def test_drafting_must_beat_target_only_by_the_margin(acceptance, drafts):
    """verify(K) = 53 + 3K ms (the prior curve), a free local chain: K = 1 is predicted at (1 + a) / 56 tokens
    a ms against K = 0's 1 / 53, 1.03x for a = 0.09 (not enough: PolicyConfig.min_gain is 1.05) and
    1.14x for a = 0.2. A greedy session judges its local chains for free, so K = 0 rounds probe nothing."""
    priors = SharedPriors()
    priors.learn(PROMPT_LOOKUP, True, acceptance=acceptance)
    s = Offer(PROMPT_LOOKUP, priors=priors)
    s.next = Proposal(PROMPT_LOOKUP, [100])
    policy = Policy(PolicyConfig(max_k=1))
    ks = [(c.k if (c := policy.choose([s], ask(k=1))) else 0) for _ in range(12)]
    assert ks == [1 if drafts else 0] * 12
