"""Sampling math shared by the draft and target tiers.

Notation (Leviathan et al. 2023; vLLM's words): p = target distribution, q = draft distribution, both
after the same temperature / top-k / top-p. d_1..d_K are the draft tokens. A round accepts a prefix
of the drafts and emits one more token: the *recovered* token drawn from norm(max(0, p_j - q_j)) at
the first rejection j, or the *bonus* token drawn from p_{K+1} when all K are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.prefix import GOLDEN_GAMMA, mix64

_MASK64 = (1 << 64) - 1
# Temperatures below this are greedy (as in vLLM): logits / T would overflow float32 to inf / NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or < GREEDY_TEMPERATURE) = greedy: p and q one-hot on their argmax
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> probabilities under temperature, then top-k, then top-p (Hugging Face's order and
    tie rules). Greedy gives one-hot rows on the argmax (first index on ties, like torch.argmax).

    logits: [N, V] -> returns float32 [N, V], each row summing to 1.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        x = x.masked_fill(_top_p_remove(x, params.top_p), -math.inf)
    return x.softmax(dim=-1)


TOP_P_CANDIDATES = 1024  # the nucleus is searched among this many most likely tokens first


def _top_p_remove(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask [N, V] of tokens outside the nucleus: a token is kept iff the probability of the tokens
    ranked strictly above it is < top_p (Hugging Face's rule: drop it if the cumulative mass up to and
    including it, in ascending order, is <= 1 - top_p). The most likely token is always kept.

    Sorting all V logits per row costs ~1 ms on a CPU; the nucleus almost always lies within the top
    TOP_P_CANDIDATES, so those are sorted first and the full sort is the fallback."""
    probs = x.softmax(dim=-1)
    vocab = x.shape[-1]
    m = min(TOP_P_CANDIDATES, vocab)
    while True:
        top_probs, top_idx = torch.topk(probs, m, dim=-1)  # [N, m], descending
        if m == vocab or bool((top_probs.sum(dim=-1) >= top_p).all()):
            break
        m = vocab  # some row's nucleus is wider than the candidates: sort everything
    above = top_probs.cumsum(dim=-1) - top_probs  # mass ranked strictly above each candidate
    remove = torch.ones_like(x, dtype=torch.bool)
    return remove.scatter(-1, top_idx, above >= top_p)


def truncate_top_n(probs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the top_n most likely tokens of one distribution, drop zeros, renormalise.

    probs: [V] -> (token_ids [n] int64, probs [n] float32 summing to 1), most likely first.
    This truncated q is what the draft samples from and what it sends to the target.
    """
    n = min(top_n, probs.shape[-1])
    vals, ids = torch.topk(probs, n)
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    vals = vals.float()
    return ids, vals / vals.sum()


def rejection_sample(
    p: torch.Tensor,  # [K+1, V] target probabilities at the K draft positions plus the bonus position
    q: torch.Tensor,  # [K, V] draft probabilities the draft tokens were sampled from
    draft_tokens: torch.Tensor,  # [K] int64: d_1..d_K
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling. Returns (n_accepted, next_token).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), stopping at the first rejection j;
    then draw the recovered token from norm(max(0, p_j - q_j)), or the bonus token from p_{K+1} if
    all K were accepted. Greedy is the limit case: p and q one-hot, so d_i is accepted iff it is
    argmax p_i, and the next token is argmax p at the stop position.

    Edge cases, on purpose:
      * q_i(d_i) = 0: rejected (the draft could not have sampled it; vLLM does the same).
      * residual sums to 0 (p_j == q_j exactly): fall back to p_j.
      * K = 0: plain sampling from p_1.
    """
    k = draft_tokens.shape[0]
    n_accepted = k
    if k > 0:
        positions = torch.arange(k, device=p.device)
        p_d = p[positions, draft_tokens]  # [K] p_i(d_i)
        q_d = q[positions, draft_tokens]  # [K] q_i(d_i)
        u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)  # [K] ~ U[0, 1)
        accepted = (q_d > 0) & (u * q_d < p_d)  # u < p/q without dividing by q
        rejected = (~accepted).nonzero()
        if rejected.numel() > 0:
            n_accepted = int(rejected[0, 0])
    if n_accepted == k:
        dist = p[k]  # bonus
    else:
        residual = (p[n_accepted] - q[n_accepted]).clamp_min(0)  # max(0, p_j - q_j)
        dist = residual if residual.sum() > 0 else p[n_accepted]
    next_token = int(torch.multinomial(dist, 1, generator=generator)[0])
    return n_accepted, next_token


def verify_greedy(
    target_logits: torch.Tensor,  # [K+1, V] target logits at the K draft positions plus the bonus position
    draft_tokens: torch.Tensor,  # [K] int64
) -> tuple[int, int]:
    """rejection_sample's temperature-0 limit without materialising one-hot p and q: accept d_i while
    it equals argmax p_i; the next token is argmax p at the stop position (the recovered token, or the
    bonus). tests/test_sampling.py pins it to rejection_sample on one-hot inputs."""
    target_argmax = target_logits.argmax(dim=-1)  # [K+1]
    k = draft_tokens.shape[0]
    mismatch = (target_argmax[:k] != draft_tokens).nonzero()
    n_accepted = int(mismatch[0, 0]) if mismatch.numel() > 0 else k
    return n_accepted, int(target_argmax[n_accepted])


def dense_q(
    rows: list[tuple[torch.Tensor, torch.Tensor]] | None,  # K x (token_ids [n_i], probs [n_i])
    draft_tokens: torch.Tensor,  # [K]
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Build q [K, V] from sparse rows, or one-hot on the draft tokens when rows is None
    (greedy rounds and deterministic proposers)."""
    k = draft_tokens.shape[0]
    if rows is None:
        return torch.nn.functional.one_hot(draft_tokens.to(device), vocab_size).float()
    q = torch.zeros(k, vocab_size, dtype=torch.float32, device=device)
    for i, (ids, probs) in enumerate(rows):
        q[i, ids.to(device)] = probs.to(device, torch.float32)
    return q


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a distribution probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator)[0])


# --- Seeds -----------------------------------------------------------------------------------------
# Randomness is a pure function of (request seed, position, stream), never of a tier's state, so a
# session that is evicted and re-prefilled, or moved to another replica, draws the same numbers. The
# draft and the target use different streams: their draws must be independent for losslessness.

DRAFT_STREAM = 1
TARGET_STREAM = 2


def _splitmix64(x: int) -> int:
    return mix64(x + GOLDEN_GAMMA)


def derive_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed for one round's draws in one stream; position = committed length."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream) >> 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
