"""What a tier's step costs at its current load: the prices the policy and the strategies quote. With B sessions
per step all sending K, a round takes wait + overhead(K) + T_step(B (K + 1)); B is never fewer than the sessions
this coordinator has open on the tier, so a burst is priced at its batch from its first round (docs/DESIGN.md,
Choosing the proposer and K)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from itertools import accumulate

import numpy as np

from coordinator.proposers.estimates import LinearCost

STEPS_REMEMBERED = 256  # the distinct steps whose ids TierCost keeps, to count each once (its replies arrive together)


class StepCurve:
    """T_step(n, B): a step's time (ms) against its tokens n, for steps of about B sessions. At each (n, B), a
    weighted least-squares line in n through the tier's measured points (weight `measured_weight`) and the last
    `window` reported steps (weight decay^age), each also weighted by Gaussians in log n and log B `width` wide;
    where the nearby points had one size the prior slope stands in, with none the prior line. Fits are cached
    per (n, B) and redone after `refresh` new steps, all of a round's sizes in one numpy pass."""

    def __init__(self, window: int = 128, width: float = 0.5, decay: float = 0.99, refresh: int = 16,
                 prior_intercept: float = 50.0, prior_slope: float = 3.0, measured_weight: float = 0.3) -> None:
        self.width, self.decay, self.refresh, self.measured_weight = width, decay, refresh, measured_weight
        self.prior = (prior_intercept, prior_slope)
        self._measured: list[tuple[float, float, float]] = []  # (log n, log B, ms) the tier timed at start
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)  # reported steps, oldest first
        self._cache: dict[tuple[int, int], float] = {}
        self._since = 0  # steps since the cache was cleared
        self._points = None  # (weight, log n, log B, ms, n) arrays, rebuilt after a new step

    def seed(self, points) -> None:
        """The tier's measured (sessions, tokens, ms) points."""
        self._measured = [(math.log(max(n, 1)), math.log(max(b, 1)), ms) for b, n, ms in points]
        self._cache.clear()
        self._points = None

    def observe(self, n: int, ms: float, sessions: int = 1) -> None:
        self._steps.append((math.log(max(n, 1)), math.log(max(sessions, 1)), ms))
        self._points = None
        self._since += 1
        if self._since >= min(self.refresh, len(self._steps)):
            self._cache.clear()
            self._since = 0

    def predict(self, n: float, sessions: float = 1.0) -> float:
        return self.predict_many([n], sessions)[0]

    def predict_many(self, ns, sessions: float = 1.0) -> list[float]:
        """predict(n, sessions) for each n, the sizes not cached fitted at once."""
        b = max(int(round(sessions)), 1)
        keys = [(max(int(round(n)), 1), b) for n in ns]
        missing = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if missing:
            self._fit(missing)
        return [self._cache[k] for k in keys]

    def _fit(self, keys: list[tuple[int, int]]) -> None:
        if self._points is None:
            last = len(self._steps) - 1
            rows = [(self.measured_weight, *p) for p in self._measured]
            rows += [(self.decay ** (last - i), *p) for i, p in enumerate(self._steps)]
            a = np.array(rows, dtype=np.float64).reshape(-1, 4)
            self._points = (a[:, 0], a[:, 1], a[:, 2], a[:, 3], np.exp(a[:, 1]))
        age, log_n, log_b, ms, x = self._points
        d = (log_n[None, :] - np.log([float(k[0]) for k in keys])[:, None]) / self.width
        e = (log_b[None, :] - np.log([float(k[1]) for k in keys])[:, None]) / self.width
        w = age[None, :] * np.exp(-0.5 * (d * d + e * e))  # keys x points
        sw, swx, swy, swxx, swxy = w.sum(1), w @ x, w @ ms, w @ (x * x), w @ (x * ms)
        for i, key in enumerate(keys):
            if sw[i] < 1e-300:  # no points, or all thousands of times larger or smaller
                self._cache[key] = max(self.prior[0] + self.prior[1] * key[0], 1e-6)
                continue
            mean_x, mean_y = swx[i] / sw[i], swy[i] / sw[i]
            var = swxx[i] / sw[i] - mean_x * mean_x
            slope = self.prior[1] if var <= (0.05 * mean_x) ** 2 else max((swxy[i] / sw[i] - mean_x * mean_y) / var, 0.0)
            self._cache[key] = max(float(mean_y + slope * (key[0] - mean_x)), 1e-6)


class TierCost:
    """A tier as the coordinator prices it, shared by all of a coordinator's sessions: its step curve (each step
    once, however many of its sessions' replies report it), sessions per step (per reply: the batch a session's
    call meets), the wait a call meets before its first step (the step in progress, at most one step: a longer
    wait, behind another session's prompt, stalls every session alike), a call's overhead beyond the step
    (network, serialisation: a line in the drafts it carries), and the sessions open on it now."""

    def __init__(self, decay: float = 0.98, prior_intercept: float = 50.0, prior_slope: float = 3.0) -> None:
        self.decay = decay
        self.step_cost = StepCurve(prior_intercept=prior_intercept, prior_slope=prior_slope)
        self.sessions = 1.0  # sessions per step, exponentially weighted over the replies
        self.overhead = LinearCost(decay)
        self.wait = 0.0  # ms before a call's first step, exponentially weighted, capped at a step at the batch then
        self.observations = 0
        self.live = 0  # sessions this coordinator has open on the tier now (generations in progress)
        self.max_sessions = 0  # the tier's batch limit (ModelInfo.max_batch_sessions; 0 = unknown)
        self.feed_token_ms = 0.0  # a token fed and not scored (a catch-up), from the tier's feed_cost (0: unknown)
        self._counted: OrderedDict[int, None] = OrderedDict()  # ids of the steps last put on the curve

    def seed(self, status, max_sessions: int = 0) -> None:
        """What the tier reported at start: its StatusResponse (cost_curve, feed_cost) and its batch limit."""
        self.step_cost.seed([(p.sessions, p.tokens, p.ms) for p in status.cost_curve])
        feeds = sorted((p.tokens, p.ms) for p in status.feed_cost)
        if len(feeds) >= 2:  # the slope between the smallest and the largest prefill
            (n0, ms0), (n1, ms1) = feeds[0], feeds[-1]
            self.feed_token_ms = max(ms1 - ms0, 0.0) / max(n1 - n0, 1)
        self.max_sessions = max_sessions

    @property
    def batch(self) -> float:
        """B: the sessions a step holds now."""
        live = min(self.live, self.max_sessions) if self.max_sessions else self.live
        return max(self.sessions, live, 1.0)

    def observe(self, batch_sessions: int, batch_tokens: int, step_ms: float, wall_ms: float,
                compute_ms: float = 0.0, queue_ms: float = 0.0, drafts: int = 0, step_id: int = 0,
                wait_ms: float = 0.0) -> None:
        """A reply: its step's sessions, tokens, time and id (0: none, the reply counts as a step of its own),
        and the call's own times (wait_ms: before its first step, part of queue_ms). A tier that reports no
        batching (a fake, an older replica) is taken as running this call alone: a step of its drafts + 1."""
        if batch_sessions <= 0 or batch_tokens <= 0:
            batch_sessions, batch_tokens, step_ms = 1, drafts + 1, wall_ms - queue_ms
        d = self.decay if self.observations else 0.0
        if self._first_report(step_id):
            self.step_cost.observe(batch_tokens, step_ms, batch_sessions)
        self.sessions = d * self.sessions + (1 - d) * batch_sessions
        self.wait = d * self.wait + (1 - d) * min(max(wait_ms, 0.0), self.step_ms(1))
        self.overhead.observe(drafts, max(0.0, wall_ms - (compute_ms or step_ms) - queue_ms))
        self.observations += 1

    def _first_report(self, step_id: int) -> bool:
        """No reply has reported this step before (or it has no id)."""
        if not step_id:
            return True
        if step_id in self._counted:
            return False
        self._counted[step_id] = None
        if len(self._counted) > STEPS_REMEMBERED:
            self._counted.popitem(last=False)
        return True

    def step_ms(self, tokens_each: float) -> float:
        """One step at the current batch with `tokens_each` new tokens per session."""
        return self.step_cost.predict(self.batch * tokens_each, self.batch)

    def verify_ms(self, n: int) -> list[float]:
        """A round scoring k = 0..n drafts when the step's B sessions all send k, never falling: the wait for
        the step in progress, the call's overhead and the whole step."""
        b = self.batch
        steps = self.step_cost.predict_many([b * (k + 1) for k in range(n + 1)], b)
        return list(accumulate((max(self.wait + self.overhead.predict(k) + steps[k], 1e-6) for k in range(n + 1)), max))
