"""A reduced draft vocabulary and the full one: q over the target's vocabulary from q over the draft's.

An EAGLE-3 head (specdec.engine.eagle3) may score only Vd <= V tokens. Its checkpoint maps them back the
way the EAGLE authors, SpecForge, vLLM and SGLang do: `d2t` [Vd] holds an OFFSET, draft id d standing for
target id d + d2t[d] (one-to-one; the published maps are increasing), and `t2d` [V] is the boolean mask of
the target ids some draft id stands for.

For verification q must be a distribution over the target's V tokens: q(x) = q_d(d) where x = d + d2t[d],
and q(x) = 0 for every x outside the draft vocabulary. A token with q = 0 is never proposed, and rejection
sampling (specdec.math.rejection) stays exact: the residual max(0, p - q) then keeps all of p's mass there.
"""

from __future__ import annotations

import torch


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] int64: the target id each draft id stands for (d + d2t[d])."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def full_vocab_probs(
    q_draft: torch.Tensor,  # [..., Vd] the head's distribution over its own vocabulary
    d2t: torch.Tensor,  # [Vd] int64 offsets: draft id d is target id d + d2t[d]
    vocab_size: int,  # V, the target's vocabulary
) -> torch.Tensor:
    """[..., V] q over the target's vocabulary: q_draft scattered to each draft id's target id, 0 elsewhere."""
    q = q_draft.new_zeros(*q_draft.shape[:-1], vocab_size)
    q[..., target_ids(d2t)] = q_draft
    return q


def t2d_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: True at the target ids the draft vocabulary covers (the checkpoint's `t2d`)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    mask[target_ids(d2t)] = True
    return mask


def d2t_from_target_ids(ids: torch.Tensor) -> torch.Tensor:
    """[Vd] int64 offsets for a draft vocabulary made of the target ids `ids` (any order; sorted here, as the
    published maps are): d2t[d] = sorted(ids)[d] - d."""
    ids = torch.unique(ids.long())  # sorted, distinct
    return ids - torch.arange(ids.shape[0], device=ids.device)


def mapping_error(d2t: torch.Tensor, vocab_size: int) -> str | None:
    """Why `d2t` is not a one-to-one map of Vd draft ids into [0, V), or None if it is."""
    if d2t.dim() != 1:
        return f"d2t has shape {tuple(d2t.shape)}, expected one dimension"
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        return f"d2t has dtype {d2t.dtype}, expected an integer type"
    ids = target_ids(d2t)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        return f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {vocab_size})"
    if torch.unique(ids).numel() != ids.numel():
        return "d2t maps two draft ids to one target id"
    return None
