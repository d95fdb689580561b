"""Seeds: randomness as a pure function of (request seed, position, stream); no torch needed.

A session that is evicted and re-prefilled, moved to another replica, or batched with others draws the
same numbers. The draft and the target use different streams: their draws must be independent for
losslessness.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread bijection on 64-bit integers."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


DRAFT_STREAM = 1
TARGET_STREAM = 2
RACE_STREAM = 4  # a seeded request's keyed race (specdec.math.race): the key both tiers draw with


def _splitmix64(x: int) -> int:
    return mix64(x + GOLDEN_GAMMA)


def derive_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed for one round's draws in one stream; position = committed length."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream) >> 1
