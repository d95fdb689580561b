"""Which strategy proposes a round, and what shape: the most predicted tokens per predicted second, K = 0
included at the target's current price, the coordinator's own CPU charged per tier call (docs/DESIGN.md,
Choosing the proposer and K, has the measurements behind each rule)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.proposers.coordinator_cost import round_ms
from coordinator.proposers.strategy import Ask, Prediction, Strategy
from specdec.core.limits import MAX_RUN_ON


@dataclass(frozen=True)
class PolicyConfig:
    """Adaptive K: the policy choosing each round's strategy and shape."""

    max_k: int = 8  # the deepest proposal tried (drafts per path)
    probe_every: int = 8  # when K = 0 wins, probe a K = 1 this often
    probe_max_every: int = 64  # probes that keep losing back off, the interval doubling up to this
    probe_budget: float = 0.02  # a probe, on its turn, waits until its predicted loss against K = 0 is within this share of the target-only time since the last one
    min_gain: float = 1.05  # draft only where the predicted tokens per unit of time beat K = 0's by this factor
    price_coordinator: bool = True  # charge the coordinator's own CPU per tier call, in series and as a floor under load
    run_on: int = 8  # a round may let the target decode up to this many more tokens itself after its verdict (1, 3, 7, ... as target-only rounds, or drafting ones the policy prices so, follow one another; 0: never)
    run_on_whole: int = 32  # the same for a request with no stop strings whose caller reads only the whole result (GenerateRequest.whole_result, OpenAI's stream false), or gets the run-on in parts (run_on_part): no reader waits on a round's end
    run_on_part: int = 0  # a stream's round sends its tokens in parts of this many as the target decodes them (no logprobs asked), so its run-on may be run_on_whole long; 0: with the verdict, run_on long

    def __post_init__(self) -> None:
        if not 0.0 <= self.probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in [0, 1], got {self.probe_budget}")
        for name in ("run_on", "run_on_whole", "run_on_part"):
            if not 0 <= getattr(self, name) <= MAX_RUN_ON:
                raise ValueError(f"{name} must be in [0, {MAX_RUN_ON}], got {getattr(self, name)}")


class Policy:
    """Per session: the per-round choice among its strategies."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._since_probe = 0
        self._probe_every = config.probe_every  # doubles after each probe while K = 0 keeps winning
        self.probing = False  # the last choice was a probe (K = 0 won it): the target's run-on streak goes on after it
        self._credit = 0.0  # ms a probe may lose: probe_budget of the target-only rounds' predicted time since the last

    def choose(self, strategies: Sequence[Strategy], ask: Ask) -> Prediction | None:
        """The best prediction of any strategy, or None for K = 0 (the target alone, running on for ask.run_on
        tokens). Drafting must beat K = 0 by min_gain. A drafting round either runs on as this round's K = 0
        would (the ramp's level now: its tokens and steps added, the ramp going on) or not (the run-on ramp
        starts over after it, its charge restart_ms). While K = 0 wins, the best K = 1 is probed every
        probe_every rounds, the interval doubling, unless its strategy judges unchosen offers for free, and only
        once its predicted loss (its time less K = 0's for as many tokens) is within probe_budget of the
        target-only time since the last probe: a draft that must first be fed the whole context (the cold start)
        is probed later, not in a short request it would slow. A request's own K (ask.fixed) has no K = 0 option
        and no run-on."""
        self.probing = False
        if ask.k <= 0:
            return None
        predictions = [p for s in strategies for p in s.predict(ask)]
        now = run_on_at(ask.streak, ask.run_on)  # this round's run-on, were it K = 0
        if not ask.fixed and now > 0:
            predictions += [dataclasses.replace(p, run_on=now) for p in predictions]
        one = round_ms(ask.verify_ms[0], 1, ask.call_ms, ask.in_flight)  # a target-only round, no run-on
        restart = 0.0 if ask.fixed else restart_ms(ask.streak, ask.run_on, one - ask.step_ms)

        def rate(p: Prediction) -> float:  # tokens per ms, the coordinator's own time charged
            round_ = round_ms(p.cost_ms, p.calls, ask.call_ms, ask.in_flight)
            return (p.tokens + p.run_on) / max(round_ + (p.run_on * ask.step_ms if p.run_on else restart), 1e-6)

        best = max(predictions, key=rate, default=None)
        if ask.fixed or best is None:
            return best
        alone = one + ask.run_on * ask.step_ms  # K = 0, run on
        if rate(best) > self.config.min_gain * (1 + ask.run_on) / alone:
            self._probe_every = self.config.probe_every
            return best
        self._since_probe += 1
        self._credit += self.config.probe_budget * (one + now * ask.step_ms)  # this round, K = 0 at its run-on
        probe = max((p for p in predictions if p.k == 1 and not p.nodes and p.run_on == now), key=rate, default=None)
        if self._since_probe < self._probe_every or probe is None or probe.by.judged_unchosen:
            return None
        loss = (probe.tokens + probe.run_on) * (1 / rate(probe) - alone / (1 + ask.run_on))
        if loss > self._credit:
            return None
        self._credit, self._since_probe = 0.0, 0
        self._probe_every = min(2 * self._probe_every, max(self.config.probe_max_every, self.config.probe_every))
        self.probing = True
        return probe


def run_on_at(streak: int, cap: int) -> int:
    """The run-on of a round after `streak` rounds in a row that ran on: 0, 1, 3, 7, ... up to cap."""
    return min(cap, 2 ** min(streak, 16) - 1)


def restart_ms(streak: int, cap: int, fixed_ms: float) -> float:
    """What a drafting round costs K = 0 after `streak` target-only rounds in a row: the run-on ramp's rounds
    (1, 2, 4, ... tokens, up to cap + 1) over again before it is back where it was, against the same tokens at
    that level's rate: (s - T / (r_s + 1)) rounds, each a round's fixed time fixed_ms (the wait, the call, the
    coordinator: a round less its step), with s the levels climbed, T = 2^s - 1 their tokens, r_s the run-on
    reached. Measured through the OpenAI API at 4 streams on chat: ~49 ms a restart, more than a drafting round
    gained there (docs/DESIGN.md, Choosing the proposer and K)."""
    levels = 0
    while levels < streak and 2 ** levels - 1 < cap:
        levels += 1
    return max(fixed_ms, 0.0) * (levels - (2 ** levels - 1) / (min(cap, 2 ** levels - 1) + 1))
