"""One draw from a distribution over the vocabulary: the token at a uniform's point of its cumulative mass.

Every draw the target makes is one token from a distribution over the whole vocabulary: a round's
recovered or bonus token, a target-only token, a token tree's candidates' draw at each level. Drawn as
torch.multinomial draws one (argmax(dist / E) with E ~ Exp(1) for every token: the exponential race) it
costs one exponential per token of the vocabulary, ~0.9 ms a draw over 49,152 tokens from a CPU
generator: a sixth of the default target's step, paid by every sampled session in every step. The
inverse CDF needs one uniform u per draw: the first token whose cumulative mass exceeds u times the
total, found by binary search over the float64 cumulative sums (~60 us for 49,152 tokens). Both are exact
draws from dist; the inverse CDF is the textbook one (Devroye, "Non-Uniform Random Variate Generation",
1986, II.2), and the distribution tests (tests/test_distribution.py) check the law it gives.

Tokens of zero mass are never drawn: their cumulative sum equals their predecessor's, so no point falls
in their interval. u in [0, 1) keeps the point below the total; where float64 rounding of u x total
reaches the total itself, the last token with mass is drawn. dist need not be normalised (a residual
max(0, p - q) is drawn from as it is), but each row must have positive mass.
"""

from __future__ import annotations

import torch


def inverse_cdf(
    dist: torch.Tensor,  # [N, V] >= 0, each row with positive mass (normalised or not)
    u: torch.Tensor,  # [N] U[0, 1) draws, float64
) -> torch.Tensor:
    """[N] int64: per row, the first token whose cumulative mass exceeds u x the row's total."""
    cdf = dist.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    point = u.to(cdf.dtype)[:, None] * total  # [N, 1]
    token = torch.searchsorted(cdf, point, right=True)  # cdf[token - 1] <= point < cdf[token]
    last = torch.searchsorted(cdf, total.contiguous())  # the first token whose cumulative sum reaches the total
    return torch.minimum(token, last)[:, 0]


def uniform_at(generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1] float64: the point of one draw, the generator's next uniform."""
    return torch.rand(1, generator=generator, device=device, dtype=torch.float64)


def draw(dist: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from dist [V] (positive mass), at the generator's next uniform."""
    return int(inverse_cdf(dist[None], uniform_at(generator, dist.device))[0])
