"""The keyed race: a sampled token as a function of (seed, position, p) alone, and verification by it.

Rejection sampling (rejection.py) decides a sampled position with draws whose meaning depends on what
was proposed there: the same seed gives another output when the proposals change (another K, another
load, another session's suffix tree). Here the target's token at position t is

    x_t = argmin_v E_{t,v} / p_t(v),    E_{t,v} ~ Exp(1) i.i.d., keyed by (seed, t, v)

(the exponential race, which draws v with probability p_t(v) exactly), and a round accepts its drafts
while each equals x at its position, emitting x where the first differs, or after the last. The round's
tokens are x_L, x_(L+1), ...: the target's own ancestral sampling with those keys, so the output is a
function of the seed and the prompt, whatever was proposed; the drafts only decide how many positions a
forward confirms. A draft that races the same keys over its q (specdec.math.keyed_draws, the draft's
draws, given the same seed) equals x_t with a probability close to rejection sampling's sum min(p, q):
measured with the default pair on open prompts, 0.92x of it at temperature 0.7 and 0.86x at 1.0 a position
(docs/performance.md, Seeded requests); a deterministic draft d is accepted with probability p(d), as in
rejection sampling.

Only the RACE_TOP most likely tokens of p race their own keyed E. The rest R, with mass r, race as one:
min over R of E_v / p(v) is Exp(1) / r and its argmin is v with probability p(v) / r, independent of each
other and of the top tokens' E, so both are drawn from two keyed uniforms of the position (an
exponential, and a point of R's cumulative mass): the same law as racing every token, at the cost of a
top-k, not of an exponential per vocabulary entry.
"""

from __future__ import annotations

import torch

from specdec.math.draw import inverse_cdf
from specdec.math.keyed_draws import keyed_uniform

RACE_TOP = 64  # tokens of p that race their own keys (the draft's default q truncation, so its tokens race theirs)
_REST_KEYS = (-1, -2)  # the keyed uniforms of the rest's race: its minimum, its argmin's point (no token has them)


def race_draw(
    p: torch.Tensor,  # [R, V] float32 >= 0: each row's distribution (after temperature, top-k, ...), positive mass
    seeds: torch.Tensor,  # [R, 2] int64: each row's seed words (keyed_draws.split_seeds)
    positions: torch.Tensor,  # [R] int64: the absolute position each row's token takes
    top: int = RACE_TOP,  # tokens that race their own keys (part of the function: the same top, the same tokens)
) -> torch.Tensor:
    """[R] int64: each row's race winner x = argmin_v E_v / p(v), E keyed by (seed, position, v) for p's `top`
    most likely tokens, the rest raced as one (the module's docstring)."""
    n = min(top, p.shape[-1])
    top_p, top_ids = torch.topk(p, n, dim=-1)  # [R, n]
    keys = torch.cat([top_ids, torch.tensor(_REST_KEYS, device=p.device).expand(p.shape[0], 2)], dim=1)
    u = keyed_uniform(seeds, positions, keys)  # [R, n + 2]: the top tokens' uniforms, then the rest's two
    ratio = -torch.log(u[:, :n]).float().double() / top_p.double()  # E / p(v) (E as keyed_exponential has it); inf at p 0
    best, at = ratio.min(dim=-1)  # [R]
    x = top_ids.gather(1, at[:, None])[:, 0]
    rest = p.sum(dim=-1, dtype=torch.float64) - top_p.sum(dim=-1, dtype=torch.float64)  # r: R's mass
    rest_min = -torch.log(u[:, n]) / rest.clamp(min=0.0)  # Exp(1) / r; inf where R has no mass
    wins = ((rest_min < best) & (rest > 0)).nonzero()[:, 0]
    if wins.numel() > 0:  # (rare where the top tokens hold most of p)
        rows = p.index_select(0, wins).double().scatter_(1, top_ids.index_select(0, wins), 0.0)  # R's masses
        x = x.index_copy(0, wins, inverse_cdf(rows, u.index_select(0, wins)[:, n + 1]))
    return x
