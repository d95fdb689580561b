"""The coordinator's own time in the policy's price (coordinator.proposers.coordinator_cost): its CPU per
tier call measured from running totals, charged in series with a round and, with many generations in
flight, as the floor one event loop puts under every round; a draft-model round makes two calls.

On an H100 with the real pair the default request fell to 0.40x K = 0 at 32 clients while the policy priced
the tiers alone (docs/performance.md, On a GPU): these cases are that regime, in numbers."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.proposers.coordinator_cost import CoordinatorCost, round_ms
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.strategy import Prediction
from specdec.core.proposer_names import DRAFT_MODEL, PROMPT_LOOKUP
from tests.proposer_fakes import ask
from tests.test_policy import Fixed, chosen


def test_cpu_per_call_from_running_totals_and_idle_cpu_is_not_charged():
    cost = CoordinatorCost(decay=0.5)
    cost.sample(1.000, 100)
    assert cost.call_ms == 0.0 and cost.samples == 0  # one sample measures nothing
    cost.sample(1.010, 120)  # 10 ms of CPU over 20 calls
    assert cost.call_ms == pytest.approx(0.5)
    cost.sample(1.050, 120)  # 40 ms idle (health checks): no calls, nothing charged, re-anchored
    cost.sample(1.052, 122)  # 2 ms over 2 calls
    assert cost.call_ms == pytest.approx(0.5 * 0.5 + 0.5 * 1.0) and cost.samples == 2


def test_a_round_pays_its_calls_in_series_and_the_loads_floor():
    assert round_ms(10.0, 1, 0.0, 32) == 10.0  # nothing measured: the tiers' price
    assert round_ms(10.0, 2, 0.5, 1) == pytest.approx(11.0)  # one generation: in series
    assert round_ms(1.5, 1, 1.0, 32) == pytest.approx(32.0)  # 32 in flight: one loop serves them all
    assert round_ms(1.5, 2, 1.0, 32) == pytest.approx(64.0)  # a draft-model round: two calls each


class TwoCalls(Fixed):
    """Fixed predictions of a draft-model strategy: Propose and Verify each round."""

    def predict(self, ask) -> list[Prediction]:
        return [dataclasses.replace(p, calls=2) for p in super().predict(ask)]


@pytest.mark.parametrize("call_ms, in_flight, want", [
    (0.0, 32, (DRAFT_MODEL, 2)),  # the tiers' prices alone: 1.6 tokens in 2 ms beats 1 in 1.5 ms
    (0.05, 1, (DRAFT_MODEL, 2)),  # one generation: a loop's 0.1 ms more changes nothing
    (1.0, 32, (PROMPT_LOOKUP, 2)),  # 32 in flight on a loop of 1 ms a call: two calls a round lose, one wins
])
def test_a_saturated_coordinator_turns_draft_model_rounds_off(call_ms, in_flight, want):
    """The GPU's regime: a batched step of ~1.5 ms (K = 0 priced at 1.5 ms), the draft model's K = 2 at
    2.0 ms for 1.6 tokens, a local chain's K = 2 at 1.7 ms for 1.3 tokens."""
    drafts = TwoCalls(DRAFT_MODEL, [(2, 1.6, 2.0)])
    local = Fixed(PROMPT_LOOKUP, [(2, 1.3, 1.7)])
    base = ask()
    verify = [1.5, 1.6, 1.7] + [2.0] * (len(base.verify_ms) - 3)  # a verify of n drafts (the predictions' own)
    a = dataclasses.replace(base, verify_ms=verify, call_ms=call_ms, in_flight=in_flight)
    assert chosen(Policy(PolicyConfig()).choose([drafts, local], a)) == want
    assert chosen(Policy(PolicyConfig()).choose([drafts], a)) == (None if want[0] == PROMPT_LOOKUP else want)
