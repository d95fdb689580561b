"""SpecDecodeMetadata: a verify batch's drafts laid out for the ragged verifier, as vLLM's
v1/spec_decode/metadata.py lays them out: every session's draft tokens flattened, with cumulative counts.
Session b's target rows are [cu_num_draft_tokens[b] + b, cu_num_draft_tokens[b + 1] + b + 1): its K_b
draft positions plus its bonus position (specdec.math.rejection, "Ragged batches")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.engine.attention import to_device


@dataclass(frozen=True)
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [N] int64 on the device: every session's d_1..d_K_b, flattened
    cu_num_draft_tokens: torch.Tensor  # [B + 1] int64 on the device: 0, K_1, K_1 + K_2, ...
    num_draft_tokens: list[int]  # [B] K_b, on the host

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], device: torch.device | str) -> "SpecDecodeMetadata":
        """From each session's drafts, with one host-to-device copy."""
        ks = [len(d) for d in drafts]
        cu = [0]
        for k in ks:
            cu.append(cu[-1] + k)
        cu_t, flat = to_device([cu, [t for d in drafts for t in d]], device)
        return cls(flat, cu_t, ks)
