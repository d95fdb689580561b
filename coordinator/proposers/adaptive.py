"""Adaptive K, the estimates: what a round with K drafts from a proposer is expected to yield and cost.

With per-token acceptance a, a round with K drafts commits (1 - a^(K+1)) / (1 - a) tokens on average
(bonus included) and costs propose(K) + verify(K). propose(K), and verify(K) until the target's load is
known, are linear in K, fitted online from the session's own rounds (exponentially weighted least
squares); a is an exponentially weighted acceptance estimate. coordinator/proposers/policy.py picks the
proposer and K per round from these.

The verify cost knows the load (TierLoad). The target batches many sessions into one step, whose time
grows with the tokens in it, T_step(n), and not along one line: flat while streaming the weights bounds
it (a few tokens on a CPU, dozens on a GPU), then steep once arithmetic does, and flatter again for a
prompt's prefill. StepCurve learns it over every session's Verify responses (each reports its step's
tokens and time), shared by all sessions of the coordinator, as a fit local to each size, so that its
slope at the batch's size is the marginal cost of a token there. With B sessions per step, all choosing
K, a session's round takes its call's overhead plus the whole step: overhead + T_step(B (K + 1)), and
the policy maximises tokens per round time. That is the tier's throughput when every session does the
same: the step's fixed cost is spread over B sessions, and each draft token costs B tokens' worth of the
step's slope (it delays every session of the step), so K falls as the batch grows and stops where a
draft token no longer pays for the step time it adds (vLLM switches speculation off above a fixed batch
size; this measures where). Time spent queueing behind other sessions is not charged. With no load
data yet, the session's own linear fit of verify wall time is used.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from specdec.core.settings import setting


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per round, bonus included, for per-token acceptance a and K drafts."""
    if a >= 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class LinearCost:
    """Exponentially weighted least-squares fit of cost(K) = intercept + slope * K."""

    def __init__(self, decay: float, prior_intercept: float, prior_slope: float, prior_weight: float = 0.5) -> None:
        self.decay = decay
        self.prior = (prior_intercept, prior_slope)
        # Prior pseudo-observations at K = 1 and K = 4 pin the line until real data spreads over K.
        self._s = [0.0] * 5  # sum w, sum wx, sum wy, sum wxx, sum wxy
        for x in (1.0, 4.0):
            self._add(x, prior_intercept + prior_slope * x, prior_weight)

    def observe(self, k: int, cost: float) -> None:
        self._s = [v * self.decay for v in self._s]
        self._add(float(k), cost, 1.0)

    def _add(self, x: float, y: float, w: float) -> None:
        s = self._s
        s[0] += w
        s[1] += w * x
        s[2] += w * y
        s[3] += w * x * x
        s[4] += w * x * y
        var = s[0] * s[3] - s[1] * s[1]
        slope = max((s[0] * s[4] - s[1] * s[2]) / var if var > 1e-12 else 0.0, 0.0)
        self._line = ((s[2] - slope * s[1]) / s[0], slope)  # (intercept, slope), refitted per observation

    def line(self, measured: bool = True) -> tuple[float, float]:
        """(intercept, slope); measured=False: the prior line alone, which no timing changes."""
        return self._line if measured else self.prior

    def predict(self, k: int, measured: bool = True) -> float:
        intercept, slope = self._line if measured else self.prior
        return max(intercept + slope * k, 1e-6)


class StepCurve:
    """A tier's step time (ms) against the tokens in the step, n, for steps of about B sessions, from its
    recent steps: at each (n, B), a weighted least-squares line in n through the last `window` steps
    (locally weighted regression), each weighted by its age (decay per newer step) and by how near its
    tokens and its sessions are to n and B (Gaussians in log n and log B, `width` wide: twice or half
    counts 0.38, four times 0.02). The line's value at n is the prediction, and its slope, never below 0,
    the marginal cost of a token at that size; where the nearby steps all had one size, the prior slope
    stands in, and before any step, the prior line. Sessions matter beside tokens: each brings its own
    attention and bookkeeping, so 16 tokens cost more as 4 sessions x 4 than as one verify of 16 (40 ms
    against ~35 on a 2-core CPU), and the flat start of the curve a single session sees (a verify of up
    to 9 tokens at ~1.1x a step) is no guide to the cost of 4 sessions' drafts.

    One line over all steps cannot be flat and steep at once: on 16 clients of a 2-core CPU such a fit
    measured a slope of 1.2-1.4 ms a token and an intercept of 38-65 ms where the steps took ~57 ms at 16
    tokens and ~2.4 ms for each token more, so drafting looked cheap exactly where a full batch made it
    dear. Fits are cached per size and redone after `refresh` new steps (~0.1 ms each)."""

    def __init__(self, window: int = 128, width: float = 0.5, decay: float = 0.99, refresh: int = 16,
                 prior_intercept: float = 50.0, prior_slope: float = 3.0) -> None:
        self.width, self.decay, self.refresh = width, decay, refresh
        self.prior = (prior_intercept, prior_slope)
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)  # (log n, log B, ms), oldest first
        self._cache: dict[tuple[int, int], float] = {}
        self._since = 0  # steps since the cache was cleared

    def observe(self, n: int, ms: float, sessions: int = 1) -> None:
        self._steps.append((math.log(max(n, 1)), math.log(max(sessions, 1)), ms))
        self._since += 1
        if self._since >= min(self.refresh, len(self._steps)):
            self._cache.clear()
            self._since = 0

    def predict(self, n: float, sessions: float = 1.0) -> float:
        key = (max(int(round(n)), 1), max(int(round(sessions)), 1))
        if key not in self._cache:
            self._cache[key] = self._fit(*key)
        return self._cache[key]

    def _fit(self, n: int, sessions: int) -> float:
        if not self._steps:
            return max(self.prior[0] + self.prior[1] * n, 1e-6)
        at, at_b, last = math.log(n), math.log(sessions), len(self._steps) - 1
        sw = swx = swy = swxx = swxy = 0.0
        for i, (log_m, log_b, ms) in enumerate(self._steps):
            d, e = (log_m - at) / self.width, (log_b - at_b) / self.width
            w = self.decay ** (last - i) * math.exp(-0.5 * (d * d + e * e))
            x = math.exp(log_m)
            sw += w
            swx += w * x
            swy += w * ms
            swxx += w * x * x
            swxy += w * x * ms
        if sw < 1e-300:  # every step seen is thousands of times larger or smaller
            return max(self.prior[0] + self.prior[1] * n, 1e-6)
        mean_x, mean_y = swx / sw, swy / sw
        var = swxx / sw - mean_x * mean_x
        if var <= (0.05 * mean_x) ** 2:  # the nearby steps had one size: no slope to read from them
            slope = self.prior[1]
        else:
            slope = max((swxy / sw - mean_x * mean_y) / var, 0.0)
        return max(mean_y + slope * (n - mean_x), 1e-6)


class AcceptanceRatio:
    """Exponentially weighted (accepted drafts) / (drafts the tree expected to be accepted)."""

    def __init__(self, decay: float, prior: float = 1.0, prior_weight: float = 1.0) -> None:
        self.decay = decay
        self._accepted = prior * prior_weight  # prior: the tree's estimate is right (or SourcePriors' ratio)
        self._expected = prior_weight
        self.observations = 0

    @property
    def value(self) -> float:
        return self._accepted / self._expected

    def observe(self, accepted: int, expected: float) -> None:
        self._accepted = self._accepted * self.decay + accepted
        self._expected = self._expected * self.decay + expected
        self.observations += 1


class TierLoad:
    """A tier's batching as the coordinator sees it: step time against tokens per step, sessions per
    step, and a call's own overhead (network, serialisation) against the drafts it carries. Shared by
    all sessions."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.step_cost = StepCurve()  # ms vs tokens in a step
        self.sessions = 1.0  # sessions per step, exponentially weighted
        # A call's wall time beyond the tier's work for it (network, serialisation), a line in the drafts
        # it carries (each adds its token and its q row to both messages): the tier reports its compute
        # and its queueing separately, and queueing behind other sessions' steps is not a cost of this
        # session's tokens. Fitted without a prior (a negligible one).
        self.overhead = LinearCost(decay, 0.0, 0.0, prior_weight=1e-9)
        self.observations = 0
        self.live = 0  # sessions this coordinator has open on the tier now (generations in progress)

    @property
    def overhead_ms(self) -> float:
        """A call's overhead without drafts."""
        return self.overhead.predict(0)

    def observe(self, batch_sessions: int, batch_tokens: int, step_ms: float, wall_ms: float,
                compute_ms: float = 0.0, queue_ms: float = 0.0, drafts: int = 0) -> None:
        if batch_sessions <= 0 or batch_tokens <= 0:
            return  # a tier that reports no batching (an older replica)
        d = self.decay if self.observations else 0.0
        self.step_cost.observe(batch_tokens, step_ms, batch_sessions)
        self.sessions = d * self.sessions + (1 - d) * batch_sessions
        self.overhead.observe(drafts, max(0.0, wall_ms - (compute_ms or step_ms) - queue_ms))
        self.observations += 1

    def round_ms(self, k: int) -> float:
        """What a round with k drafts takes when the step's B sessions all send k: the call's overhead with k
        drafts and the whole step of B (k + 1) tokens. At B = 1 that is this session's own step; as B grows each draft
        token costs B tokens' worth of the step's slope (it delays every session of the step), so k is
        chosen for the tier's throughput, not for one session's latency."""
        b = max(self.sessions, 1.0)
        return self.overhead.predict(k) + self.step_cost.predict(b * (k + 1), b)

@dataclass(frozen=True)
class AdaptiveConfig:
    """Adaptive K: the policy choosing each round's proposer and K."""

    max_k: int = 8  # largest K tried
    decay: float = 0.9  # weight of the past per round (~10-round memory)
    prior_acceptance: float = 0.5  # acceptance assumed before any round
    probe_every: int = 8  # when K = 0 wins, probe K = 1 this often
    min_gain: float = 1.05  # draft only where the predicted tokens per unit of time beat K = 0's by this factor
    # Ask the draft model only while at most this many sessions verify on the target at once (0 = any
    # number). Where the tiers share a machine's cores, a draft step under load runs beside the busy
    # target's and both slow down far more than the policy's timings show (each tier's threads spin on
    # the cores the other needs); above the limit only the local proposers draft. vLLM's
    # speculative_disable_by_batch_size, counted in sessions this coordinator has open on the target.
    draft_max_sessions: int = setting(0, flag="draft-max-sessions")


class SourcePriors:
    """Where a new session's estimates start: what the coordinator's recent sessions learnt of each
    proposer, per (source, greedy or sampled): its per-token acceptance and the ratio of accepted drafts to
    those its own estimate expected (the suffix tree's), each an exponentially weighted mean over the
    sessions that measured it (MIN_ATTEMPTS drafts at least). Before any, AdaptiveConfig.prior_acceptance
    and a ratio of 1. Shared by all sessions, like TierLoad: a chat service's sessions stop opening with
    chains of prompt n-grams that its earlier sessions saw fail, and a template service's start trusting
    the suffix tree at once; a session's own rounds outweigh the prior within a few rounds either way.
    The draft model's token trees are learnt alike (per greedy or sampled): the acceptance vector of their
    siblings, and the ratios of their accepted nodes and of their rounds' time to what was predicted
    (coordinator/proposers/draft_tree.py), from sessions whose trees were judged on MIN_LEVELS levels."""

    MIN_ATTEMPTS = 4  # drafts a session must have judged for its estimates to count
    MIN_LEVELS = 4  # tree levels a session must have judged for its tree estimates to count

    def __init__(self, config: "AdaptiveConfig", decay: float = 0.7) -> None:
        self.config = config
        self.decay = decay  # weight of the earlier sessions against the newest
        self._acceptance: dict[tuple[str, bool], float] = {}
        self._ratio: dict[tuple[str, bool], float] = {}
        self._trees: dict[bool, tuple[list[float], float, float]] = {}  # greedy -> (c_r, rho, kappa)

    def acceptance(self, source: str, greedy: bool) -> float:
        return self._acceptance.get((source, greedy), self.config.prior_acceptance)

    def ratio(self, source: str, greedy: bool) -> float:
        return self._ratio.get((source, greedy), 1.0)

    def trees(self, greedy: bool) -> tuple[list[float], float, float] | None:
        """What earlier sessions' draft trees taught: (the sibling acceptance vector c_r, rho, kappa); None before any."""
        return self._trees.get(greedy)

    def _blend(self, old: float, new: float) -> float:
        """The earlier sessions' estimate moved towards the newest session's."""
        return self.decay * old + (1 - self.decay) * new

    def learn_trees(self, greedy: bool, vector: list[float], rho: float, kappa: float) -> None:
        """A finished session's tree estimates."""
        old = self._trees.get(greedy)
        if old is not None and len(old[0]) == len(vector):
            vector = [self._blend(a, b) for a, b in zip(old[0], vector)]
            rho, kappa = self._blend(old[1], rho), self._blend(old[2], kappa)
        self._trees[greedy] = (list(vector), rho, kappa)

    def learn(self, source: str, greedy: bool, acceptance: float | None, ratio: float | None) -> None:
        """A finished session's estimates (None: it did not measure that one)."""
        for table, value in ((self._acceptance, acceptance), (self._ratio, ratio)):
            if value is not None:
                key = (source, greedy)
                table[key] = value if key not in table else self._blend(table[key], value)


class SourceEstimate:
    """What one proposer's rounds have taught a session: per-token acceptance (exponentially
    weighted) and the propose and verify costs as linear fits in K. Times are in milliseconds."""

    def __init__(self, config: AdaptiveConfig, local_proposer: bool, verify_cost: LinearCost | None = None,
                 prior_acceptance: float | None = None) -> None:
        """verify_cost: a fit shared with other sources (verifying K tokens costs the same whoever proposed them).
        prior_acceptance: where the acceptance starts (default config.prior_acceptance; SourcePriors)."""
        self.config = config
        self._acc_num = config.prior_acceptance if prior_acceptance is None else prior_acceptance  # weighted accepted
        self._acc_den = 1.0  # weighted draft attempts
        self.attempts = 0  # drafts judged in this session (accepted ones and first rejections)
        # A remote draft costs about a network hop plus a few ms per token; a local proposer ~nothing.
        self.propose_cost = LinearCost(config.decay, 0.0 if local_proposer else 1.0, 0.0 if local_proposer else 5.0)
        self.verify_cost = verify_cost or LinearCost(config.decay, 50.0, 3.0)

    @property
    def acceptance(self) -> float:
        return min(self._acc_num / self._acc_den, 1.0)

    def observe(self, k: int, n_accepted: int, propose_ms: float, verify_ms: float, steady: bool = True) -> None:
        """One round: K proposed (after clamping), n accepted, and the two rpcs' wall times. steady=False:
        the proposer first caught up on many tokens (the prompt, or rounds it sat out), so its time is
        not what a K-token proposal costs when it drafts every round, and does not enter the fit."""
        if k > 0:
            self.observe_acceptance(k, n_accepted)
            if steady:
                self.propose_cost.observe(k, propose_ms)
        self.verify_cost.observe(k, verify_ms)

    def observe_acceptance(self, k: int, n_accepted: int) -> None:
        """n of k drafts accepted: each accepted draft is a success, the first rejection (if any) a failure."""
        d = self.config.decay
        attempts = n_accepted + (1 if n_accepted < k else 0)
        self._acc_num = self._acc_num * d + n_accepted
        self._acc_den = self._acc_den * d + attempts
        self.attempts += attempts

    def cost(self, k: int, measured: bool = True) -> float:
        """Predicted wall time of a round with k drafts from this source (k = 0: target only);
        measured=False: from the priors only, the same in every run."""
        return self.verify_cost.predict(k, measured) + (self.propose_cost.predict(k, measured) if k > 0 else 0.0)
