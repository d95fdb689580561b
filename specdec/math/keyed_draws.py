"""The draft's draws as a pure function of (seed, position, token), computed on the device.

A draft token at position i is drawn from q_i, the draft's distribution truncated to its top n tokens
and renormalised. Drawing it with the exponential race (argmax_t q(t) / E_t with E_t ~ Exp(1) i.i.d.
is a draw from q: the Gumbel-max trick written with exponentials, as torch.multinomial does) needs one
Exp(1) variable per candidate token. Here E_t is not taken from a stateful generator but computed from
a counter-based hash of (seed, position, token id): the same numbers whatever the batch, the device,
the order of the candidates or whether the step ran alone, in a loop on the device or inside a captured
CUDA graph (where a host generator cannot be advanced). Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3" (SC 2011), is the case for counter-based generators; the hash below is a 32-bit
integer finaliser (three xor-shift-multiply rounds) applied per input word, in int64 arithmetic that
never overflows, so it runs on any torch device.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # the finaliser's multiplier: < 2**27, so (x < 2**32) * _MUL < 2**59 fits int64
_TOKEN_SALT = 0x9E3779B9  # keeps token 0 of position 0 away from the hash's fixed point


def _mix32(x):
    """A well-spread map of 32-bit values (held in int64) to 32-bit values."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def split_seeds(seeds: list[int], device) -> torch.Tensor:
    """63-bit seeds -> [B, 2] int64 (high and low 32-bit words), the form keyed_exponential takes."""
    return torch.tensor([[(s >> 32) & _M32, s & _M32] for s in seeds], dtype=torch.long, device=device)


def keyed_uniform(
    seeds: torch.Tensor,  # [B, 2] int64: each row's seed words (split_seeds)
    positions: torch.Tensor,  # [B] int64: the absolute position each row's token will take
    token_ids: torch.Tensor,  # [B, n] int64: the candidate tokens (any int: a negative id keys a draw of no token)
) -> torch.Tensor:
    """U(0, 1) variables U[b, j], a pure function of (seed b, position b, token j): [B, n] float64, 32 bits each.
    On a CPU the hash runs in numpy (the same int64 arithmetic: ~1 us an operation against torch's ~4)."""
    if token_ids.device.type == "cpu":
        return torch.from_numpy((_hash(seeds.numpy(), positions.numpy(), token_ids.numpy()) + 0.5) / 4294967296.0)
    return (_hash(seeds, positions, token_ids).double() + 0.5) / 4294967296.0  # (0, 1)


def _hash(seeds, positions, token_ids):
    """The 32-bit hash of (seed, position, token), on torch tensors or numpy arrays alike."""
    h = _mix32((token_ids + _TOKEN_SALT) & _M32)
    h = _mix32(h ^ (positions[:, None] & _M32))
    h = _mix32(h ^ seeds[:, :1])
    return _mix32(h ^ seeds[:, 1:])


def keyed_exponential(
    seeds: torch.Tensor,  # [B, 2] int64: each row's seed words (split_seeds)
    positions: torch.Tensor,  # [B] int64: the absolute position each row's token will take
    token_ids: torch.Tensor,  # [B, n] int64: the candidate tokens
) -> torch.Tensor:
    """Exp(1) variables E[b, j] = -log U[b, j] (keyed_uniform): [B, n] float32."""
    return (-torch.log(keyed_uniform(seeds, positions, token_ids))).float()


def draw_top_n(
    probs: torch.Tensor,  # [B, V] float32: each row's distribution (after temperature, top-k, ...)
    top_n: torch.Tensor,  # [B] int64: each row's truncation, 1..n_max
    n_max: int,  # the widest truncation in the batch
    seeds: torch.Tensor,  # [B, 2] int64 (split_seeds)
    positions: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_b = probs_b truncated to its top_n[b] most likely tokens and renormalised, and one draw from
    each: -> (token [B] int64, q token ids [B, n_max] int64 most likely first, q probs [B, n_max] float32,
    0 past a row's truncation or where probs is 0). No host synchronisation."""
    vals, ids = torch.topk(probs, n_max, dim=-1)  # [B, n_max], descending
    keep = torch.arange(n_max, device=probs.device)[None, :] < top_n[:, None]  # [B, n_max]
    vals = torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
    q = vals / vals.sum(dim=-1, keepdim=True)
    race = q / keyed_exponential(seeds, positions, ids)  # [B, n_max]; 0 outside q's support
    token = ids.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
    return token, ids, q
