"""The small online estimates the strategies are made of, and the priors sessions hand on to the next.

With per-token acceptance a, a round of K drafts commits (1 - a^(K+1)) / (1 - a) tokens on average (the
bonus included): expected_tokens. Acceptance is an exponentially weighted ratio of accepted drafts to
drafts judged; Ratio scales a strategy's own estimate (the suffix tree's probabilities, a tree's reach, a
predicted time) by how it has fared; LinearCost is an exponentially weighted least-squares line in K.
SharedPriors is where a new session's estimates start: what the coordinator's earlier sessions measured,
per strategy and per greedy or sampled (not for reproducible requests, which no other session may sway).
"""

from __future__ import annotations


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per round, bonus included, for per-token acceptance a and K drafts."""
    if a >= 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Ratio:
    """Exponentially weighted sum(observed) / sum(predicted), starting at `prior` (worth prior_weight)."""

    def __init__(self, decay: float, prior: float = 1.0, prior_weight: float = 1.0) -> None:
        self.decay = decay
        self._num, self._den = prior * prior_weight, prior_weight
        self.observations = 0

    @property
    def value(self) -> float:
        return self._num / self._den

    def observe(self, observed: float, predicted: float) -> None:
        self._num = self._num * self.decay + observed
        self._den = self._den * self.decay + predicted
        self.observations += 1


class Acceptance(Ratio):
    """Per-token acceptance: each accepted draft a success, the first rejection (if any) a failure."""

    def __init__(self, decay: float, prior: float) -> None:
        super().__init__(decay, prior)
        self.attempts = 0  # drafts judged (accepted ones and first rejections)

    @property
    def value(self) -> float:
        return min(super().value, 1.0)

    def judge(self, k: int, n_accepted: int) -> None:
        """n of k drafts accepted."""
        attempts = n_accepted + (1 if n_accepted < k else 0)
        self.observe(n_accepted, attempts)
        self.attempts += attempts


class LinearCost:
    """Exponentially weighted least-squares fit of cost(x) = intercept + slope * x (slope >= 0)."""

    def __init__(self, decay: float, prior_intercept: float, prior_slope: float, prior_weight: float = 0.5) -> None:
        self.decay = decay
        self.prior = (prior_intercept, prior_slope)
        self._s = [0.0] * 5  # sum w, sum wx, sum wy, sum wxx, sum wxy
        for x in (1.0, 4.0):  # prior pseudo-observations pin the line until real data spreads over x
            self._add(x, prior_intercept + prior_slope * x, prior_weight)

    def observe(self, x: float, cost: float) -> None:
        self._s = [v * self.decay for v in self._s]
        self._add(float(x), cost, 1.0)

    def _add(self, x: float, y: float, w: float) -> None:
        s = self._s
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            s[i] += v
        var = s[0] * s[3] - s[1] * s[1]
        slope = max((s[0] * s[4] - s[1] * s[2]) / var if var > 1e-12 else 0.0, 0.0)
        self._line = ((s[2] - slope * s[1]) / s[0], slope)  # (intercept, slope), refitted per observation

    def predict(self, x: float, measured: bool = True) -> float:
        """measured=False: the prior line alone, which no timing changes."""
        intercept, slope = self._line if measured else self.prior
        return max(intercept + slope * x, 1e-6)


class SharedPriors:
    """What earlier sessions measured, per (strategy, greedy): named values (numbers or vectors), each an
    exponentially weighted mean over the sessions that taught it. Shared by the coordinator's sessions: a chat
    service's sessions stop opening with chains its earlier sessions saw fail, a template service's start
    trusting the suffix tree at once; a session's own rounds outweigh the prior within a few rounds."""

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay  # weight of the earlier sessions against the newest
        self._values: dict[tuple[str, bool], dict[str, float | list[float]]] = {}

    def get(self, strategy: str, greedy: bool, name: str, default=None):
        return self._values.get((strategy, greedy), {}).get(name, default)

    def learn(self, strategy: str, greedy: bool, **values: float | list[float] | None) -> None:
        """A finished session's estimates (None: it did not measure that one)."""
        table = self._values.setdefault((strategy, greedy), {})
        for name, new in values.items():
            old = table.get(name)
            if new is None:
                continue
            if isinstance(new, list):
                table[name] = list(new) if not isinstance(old, list) or len(old) != len(new) else [
                    self._blend(a, b) for a, b in zip(old, new)]
            else:
                table[name] = new if old is None else self._blend(old, new)

    def _blend(self, old: float, new: float) -> float:
        return self.decay * old + (1 - self.decay) * new
