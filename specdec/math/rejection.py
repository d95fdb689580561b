"""Lossless verification: rejection sampling of draft tokens against the target distribution.

Notation (Leviathan et al. 2023; vLLM's words): p = target distribution, q = draft distribution, both
after the same temperature / top-k / top-p. d_1..d_K are the draft tokens. A round accepts a prefix
of the drafts and emits one more token: the *recovered* token drawn from norm(max(0, p_j - q_j)) at
the first rejection j, or the *bonus* token drawn from p_{K+1} when all K are accepted.
"""

from __future__ import annotations

import torch


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
