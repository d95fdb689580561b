"""Ragged attention over the slot KV cache, plugged into transformers' attention interface.

A batched step is one flat sequence of T tokens (batch dimension 1) holding every scheduled session's
new tokens back to back, with per-token positions for the rotary embedding. For each layer this
function stores the step's keys and values in the sessions' slots, then lets each session's queries
attend to its own slot prefix: causal within the new tokens, everything before them. Sessions never
see each other's tokens, so batching changes no session's attention inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.engine.kv_cache import SlotKVCache

ATTENTION = "specdec_ragged"  # the name registered with transformers' AttentionInterface


@dataclass
class Segment:
    """One session's part of a step."""

    slot: int
    start: int  # first of its tokens in the flat step
    end: int  # one past its last token
    kv_len: int  # tokens in its slot after this step (cached before + new)
    mask: torch.Tensor | None  # [new, kv_len] bool, True = may attend; None for a single new token


@dataclass
class StepLayout:
    cache: SlotKVCache
    slots: torch.Tensor  # [T] int64 slot of each token
    positions: torch.Tensor  # [T] int64 position of each token in its session
    segments: list[Segment]


def causal_mask(cached: int, new: int, device: torch.device) -> torch.Tensor | None:
    """[new, cached + new]: query i (at position cached + i) sees positions <= cached + i."""
    if new == 1:
        return None
    keys = torch.arange(cached + new, device=device)
    return keys[None, :] <= (cached + torch.arange(new, device=device))[:, None]


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, T, D], key / value [1, H_kv, T, D] (the step's new tokens, rotary applied).
    Returns ([1, T, H, D], None) as transformers' attention functions do."""
    step: StepLayout = kwargs["specdec_step"]
    layer = module.layer_idx
    step.cache.write(layer, step.slots, step.positions, key[0], value[0])
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    for seg in step.segments:
        k, v = step.cache.view(layer, seg.slot, seg.kv_len)
        o = F.scaled_dot_product_attention(query[:, :, seg.start : seg.end], k, v, attn_mask=seg.mask,
                                           scale=scaling, enable_gqa=True)  # [1, H, new, D]
        out[0, seg.start : seg.end] = o[0].transpose(0, 1)
    return out, None


AttentionInterface.register(ATTENTION, ragged_attention)
