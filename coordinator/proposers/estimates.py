"""The small online estimates strategies are made of, and the priors sessions hand on to the next."""

from __future__ import annotations


def expected_tokens(a: float, k: int) -> float:
    """E(K): tokens a round of K drafts commits, the bonus included, at per-token acceptance a."""
    return k + 1.0 if a >= 1.0 - 1e-9 else (1.0 - a ** (k + 1)) / (1.0 - a)


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


class Calibration:
    """c(r): how often a draft was right, given those before it (its parent) were, whose offer estimated that
    chance at r, per level of r (upper edges EDGES), exponentially weighted per round; each level starts at
    `prior` (earlier sessions' measurements) or at its middle (the estimate taken at its word), worth
    PRIOR_WEIGHT drafts. An offer's probs are its own running products (P(it and every draft above it right)),
    so r = p / p_parent; calibrated, a draft's chance is the product of c(r) down its path. A suffix tree's r
    are count ratios: inside an edge, a continuation seen once, every r is 1 (measured on distinct chat
    requests, such chains of 8 had 4.2 of their drafts accepted, chains of 4 one)."""

    EDGES = (0.25, 0.5, 0.75, 0.95, 1.0)
    PRIOR_WEIGHT = 2.0

    def __init__(self, decay: float, prior: list[float] | None = None) -> None:
        self.decay = decay
        start = prior if prior is not None and len(prior) == len(self.EDGES) else self.middles()
        self._hits = [self.PRIOR_WEIGHT * c for c in start]
        self._tries = [self.PRIOR_WEIGHT] * len(self.EDGES)
        self.observations = 0  # drafts judged

    @classmethod
    def middles(cls) -> list[float]:
        return [(lo + hi) / 2 for lo, hi in zip((0.0,) + cls.EDGES, cls.EDGES)]

    @classmethod
    def level(cls, r: float) -> int:
        return next((i for i, edge in enumerate(cls.EDGES) if r < edge), len(cls.EDGES) - 1)

    def __call__(self, r: float) -> float:
        i = self.level(r)
        return self._hits[i] / self._tries[i]

    @property
    def values(self) -> list[float]:
        return [h / t for h, t in zip(self._hits, self._tries)]

    @staticmethod
    def _conditionals(probs, parents):
        """(each draft's parent index or -1, r = p / p_parent)."""
        above = parents or [i - 1 for i in range(len(probs))]
        return [(a, p / probs[a] if a >= 0 and probs[a] > 0 else p) for a, p in zip(above, probs)]

    def chances(self, probs, parents=()) -> list[float]:
        """Each draft's calibrated chance of being right with every draft above it (a chain, or a tree's nodes in
        node order, parents first)."""
        out: list[float] = []
        for a, r in self._conditionals(probs, parents):
            out.append((out[a] if a >= 0 else 1.0) * self(r))
        return out

    def observe(self, probs, parents, right) -> None:
        """A round's offer judged: its drafts' probs (and parents: a tree), and the set of drafts that were right.
        A draft counts where its parent was right (every child of a node the walk reached was tried)."""
        self._hits = [h * self.decay for h in self._hits]
        self._tries = [t * self.decay for t in self._tries]
        for i, (a, r) in enumerate(self._conditionals(probs, parents)):
            if a < 0 or a in right:
                level = self.level(r)
                self._hits[level] += i in right
                self._tries[level] += 1.0
                self.observations += 1


class LinearCost:
    """Exponentially weighted least-squares fit of cost(x) = intercept + slope * x (slope >= 0); 0 until observed."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._s = [0.0] * 5  # sum w, sum wx, sum wy, sum wxx, sum wxy
        self._line = (0.0, 0.0)  # (intercept, slope), refitted per observation

    def observe(self, x: float, cost: float) -> None:
        x = float(x)
        s = [v * self.decay + new for v, new in zip(self._s, (1.0, x, cost, x * x, x * cost))]
        var = s[0] * s[3] - s[1] * s[1]
        slope = max((s[0] * s[4] - s[1] * s[2]) / var if var > 1e-12 else 0.0, 0.0)
        self._s, self._line = s, ((s[2] - slope * s[1]) / s[0], slope)

    def predict(self, x: float) -> float:
        return max(self._line[0] + self._line[1] * x, 1e-6)


class SharedPriors:
    """Where a new session's estimates start: what the coordinator's earlier sessions measured, per (strategy,
    greedy), each named value (a number or a vector) an exponentially weighted mean over the sessions that
    taught it (decay: the earlier sessions' weight against the newest)."""

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay
        self._values: dict[tuple[str, bool], dict[str, float | list[float]]] = {}

    def get(self, strategy: str, greedy: bool, name: str, default=None):
        return self._values.get((strategy, greedy), {}).get(name, default)

    def learn(self, strategy: str, greedy: bool, **values: float | list[float] | None) -> None:
        """A finished session's estimates (None: it did not measure that one)."""
        table, d = self._values.setdefault((strategy, greedy), {}), self.decay
        for name, new in values.items():
            old = table.get(name)
            if new is None:
                continue
            if isinstance(new, list):
                same = isinstance(old, list) and len(old) == len(new)
                table[name] = [d * a + (1 - d) * b for a, b in zip(old, new)] if same else list(new)
            else:
                table[name] = new if old is None else d * old + (1 - d) * new
