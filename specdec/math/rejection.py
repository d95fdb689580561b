"""Lossless verification: rejection sampling of draft tokens against the target distribution.

Notation (Leviathan et al. 2023; vLLM's words): p = target distribution, q = draft distribution, both
after the same temperature / top-k / top-p. d_1..d_K are the draft tokens. A round accepts a prefix
of the drafts and emits one more token: the *recovered* token drawn from norm(max(0, p_j - q_j)) at
the first rejection j, or the *bonus* token drawn from p_{K+1} when all K are accepted.
"""

from __future__ import annotations

import torch

from specdec.math.argmax import argmax
from specdec.math.draw import draw, inverse_cdf, uniform_at


def rejection_sample(
    p: torch.Tensor,  # [K+1, V] target probabilities at the K draft positions plus the bonus position
    q: torch.Tensor,  # [K, V] draft probabilities the draft tokens were sampled from
    draft_tokens: torch.Tensor,  # [K] int64: d_1..d_K
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling. Returns (n_accepted, next_token).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), stopping at the first rejection j;
    then draw the recovered token from norm(max(0, p_j - q_j)), or the bonus token from p_{K+1} if
    all K were accepted (one draw: specdec.math.draw, after the K uniforms). Greedy is the limit case: p and q
    one-hot, so d_i is accepted iff it is argmax p_i, and the next token is argmax p at the stop position.

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
    return n_accepted, draw(dist, generator)


def verify_greedy(
    target_logits: torch.Tensor,  # [K+1, V] target logits at the K draft positions plus the bonus position
    draft_tokens: torch.Tensor,  # [K] int64
) -> tuple[int, int]:
    """rejection_sample's temperature-0 limit without materialising one-hot p and q: accept d_i while
    it equals argmax p_i; the next token is argmax p at the stop position (the recovered token, or the
    bonus). tests/test_rejection.py pins it to rejection_sample on one-hot inputs."""
    target_argmax = argmax(target_logits)  # [K+1]
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
    if rows is None:
        return torch.nn.functional.one_hot(draft_tokens.to(device), vocab_size).float()
    counts = [len(ids) for ids, _ in rows]
    offsets = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
    token_ids = torch.cat([ids.long() for ids, _ in rows]) if rows else torch.zeros(0, dtype=torch.long)
    probs = torch.cat([p.float() for _, p in rows]) if rows else torch.zeros(0)
    return dense_q_rows(token_ids, probs, offsets, vocab_size, device)


def dense_q_rows(
    token_ids: torch.Tensor,  # [E] int64: every row's token ids, row after row
    probs: torch.Tensor,  # [E] their probabilities
    row_offsets: torch.Tensor,  # [R + 1] int64: row r is entries row_offsets[r]:row_offsets[r + 1]
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """q [R, V] from sparse rows laid out flat with offsets (CSR): zero outside each row's tokens."""
    num_rows = row_offsets.shape[0] - 1
    q = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    if token_ids.numel() > 0:
        counts = row_offsets[1:] - row_offsets[:-1]  # [R]
        row = torch.repeat_interleave(torch.arange(num_rows), counts.cpu())  # [E] the row of each entry
        q.index_put_((row.to(device), token_ids.to(device)), probs.to(device, torch.float32))
    return q


# --- Ragged batches ------------------------------------------------------------------------------
# Many sessions verified at once, the way vLLM's rejection sampler lays them out: every session's draft
# tokens flattened into one tensor with cumulative counts, and the target rows of session b at
# [cu_num_draft_tokens[b] + b, cu_num_draft_tokens[b + 1] + b + 1) (its K_b draft positions plus its
# bonus position). No Python loop over sessions inside the tensor math (greedy's walk, a few integer
# comparisons a session after one argmax, runs on the host); the random draws come from each session's
# own generator (round_randomness), so a session's outcome never depends on its batch.


def round_randomness(
    generators: list[torch.Generator],  # one per session, seeded for this round
    num_draft_tokens: list[int],  # [B] K_b
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each session's draws in the order rejection_sample makes them: K uniforms, then the point of its
    one draw from the vocabulary (specdec.math.draw). Returns (uniform [sum K_b], at [B] float64)."""
    uniform = torch.empty(sum(num_draft_tokens), dtype=torch.float32, device=device)
    at = torch.empty(len(generators), dtype=torch.float64, device=device)
    start = 0
    for b, (gen, k) in enumerate(zip(generators, num_draft_tokens)):
        uniform[start : start + k] = torch.rand(k, generator=gen, device=device, dtype=torch.float32)
        at[b] = uniform_at(gen, device)[0]
        start += k
    return uniform, at


def rejection_sample_batched(
    p: torch.Tensor,  # [num_draft_tokens + B, V] target probabilities, each session's K_b + 1 rows
    q: torch.Tensor,  # [num_draft_tokens, V] draft probabilities of the draft tokens' positions
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64: every session's d_1..d_K, flattened
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] int64: 0, K_1, K_1 + K_2, ...
    uniform: torch.Tensor,  # [num_draft_tokens] U[0, 1) draws
    at: torch.Tensor,  # [B] U[0, 1) float64: each session's point for the recovered / bonus draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample for B sessions at once. Returns (num_accepted [B], next_token [B]), equal to
    rejection_sample per session when the draws come from round_randomness. Same edge cases:
    q(d) = 0 rejects, a residual summing to 0 falls back to p_j, K_b = 0 samples from p_1."""
    device = p.device
    num_drafts = draft_token_ids.shape[0]
    batch = cu_num_draft_tokens.shape[0] - 1
    if num_drafts == 0:  # every K_b = 0: p's rows are the B bonus rows, each drawn from as it is
        return torch.zeros(batch, dtype=torch.long, device=device), inverse_cdf(p, at)
    k = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]  # [B]
    session = torch.repeat_interleave(torch.arange(batch, device=device), k)  # [N] session of each draft
    flat = torch.arange(num_drafts, device=device)
    position = flat - cu_num_draft_tokens[session]  # [N] i - 1 within the session
    p_d = p[flat + session, draft_token_ids]  # [N] p_i(d_i)
    q_d = q[flat, draft_token_ids]  # [N] q_i(d_i)
    accepted = (q_d > 0) & (uniform * q_d < p_d)  # u < p/q without dividing by q
    first_rejected = torch.where(accepted, k[session], position)  # [N]
    num_accepted = k.clone().scatter_reduce_(0, session, first_rejected, reduce="amin")  # [B]
    all_accepted = num_accepted == k
    stop_row = cu_num_draft_tokens[:-1] + torch.arange(batch, device=device) + num_accepted  # [B] row in p
    p_stop = p[stop_row]  # [B, V]
    if num_drafts > 0:
        q_row = (cu_num_draft_tokens[:-1] + num_accepted).clamp(max=num_drafts - 1)
        q_stop = torch.where(all_accepted[:, None], 0.0, q[q_row])  # [B, V]
    else:
        q_stop = torch.zeros_like(p_stop)
    residual = (p_stop - q_stop).clamp_min(0)  # max(0, p_j - q_j); equals p_{K+1} for the bonus
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(empty, p_stop, residual)  # [B, V]
    next_token = inverse_cdf(dist, at)  # one draw per row
    return num_accepted, next_token


def verify_greedy_batched(
    target_logits: torch.Tensor,  # [N + B, V] each session's K_b + 1 rows
    draft_token_ids: list[list[int]],  # B x [K_b]: each session's d_1..d_K_b
) -> tuple[list[int], list[int]]:
    """verify_greedy for B sessions at once: (num_accepted [B], next_token [B]), as host ints. One argmax over
    every row and one copy of it to the host; the walk along each chain is a few integer comparisons, which
    on the host cost less than the ragged tensor operations would (and the caller needs ints)."""
    return walk_chains(argmax(target_logits).tolist(), draft_token_ids)


def walk_chains(x: list[int], draft_token_ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each chain's verdict given the token each row emits (the target's argmax; or its keyed race winner,
    specdec.math.race), rows session after session (K_b + 1 each): (num_accepted [B], next_token [B]). d_i is
    accepted while it equals x at its row; next_token is x at the first row whose draft differs, or at the last."""
    num_accepted, next_token = [], []
    row = 0  # session b's first row: K_1 + 1 + ... + K_(b-1) + 1
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == x[row + n]:
            n += 1
        num_accepted.append(n)
        next_token.append(x[row + n])  # the correction at the first mismatch, or the bonus
        row += len(drafts) + 1
    return num_accepted, next_token
