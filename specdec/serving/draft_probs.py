"""The wire codec of q: DraftProbs (specdec.engine.draft_probs) <-> repeated DraftDistribution rows
(common.proto). encode() is the draft's; decode() is the target's and checks everything that arrives,
each failure an INVALID_ARGUMENT naming the row and field, before any work is queued."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.core.errors import check_token_ids, invalid_argument
from specdec.engine.draft_probs import DraftProbs
from specdec.proto import common_pb2

Q_SUM_TOLERANCE = 1e-3  # a q row must sum to 1 within this


def encode(q: DraftProbs | None) -> list[common_pb2.DraftDistribution]:
    """One DraftDistribution per row; none for None (q one-hot on the drafts: nothing to send)."""
    if q is None:
        return []
    ids, probs, ends = q.token_ids.tolist(), q.probs.tolist(), q.row_offsets.tolist()
    return [common_pb2.DraftDistribution(token_ids=ids[a:b], probs=probs[a:b]) for a, b in zip(ends, ends[1:])]


def decode(rows: Sequence[common_pb2.DraftDistribution], num_rows: int, vocab_size: int,
           field_name: str = "q", rows_of: str = "draft_tokens") -> DraftProbs | None:
    """The rows as DraftProbs, or None when none were sent (one-hot q). There must be num_rows of them (one
    per entry of `rows_of`); each non-empty, ids in the vocabulary and distinct, probs finite, >= 0 and
    summing to 1."""
    if not rows:
        return None
    if len(rows) != num_rows:
        raise invalid_argument(f"{field_name} has {len(rows)} rows but {rows_of} has {num_rows}; "
                               f"send one row per draft token or none")
    ids, probs, ends = [], [], [0]
    for i, row in enumerate(rows):
        if not row.token_ids or len(row.token_ids) != len(row.probs):
            raise invalid_argument(f"{field_name}[{i}]: token_ids and probs must be non-empty and of equal length")
        check_token_ids(row.token_ids, vocab_size, f"{field_name}[{i}].token_ids")
        if len(set(row.token_ids)) != len(row.token_ids):
            raise invalid_argument(f"{field_name}[{i}].token_ids has duplicate ids")
        total = 0.0
        for prob in row.probs:
            if not (math.isfinite(prob) and prob >= 0):
                raise invalid_argument(f"{field_name}[{i}].probs must be finite and >= 0, got {prob}")
            total += prob
        if abs(total - 1.0) > Q_SUM_TOLERANCE:
            raise invalid_argument(f"{field_name}[{i}].probs sum to {total:.6f}, not 1")
        ids.extend(row.token_ids)
        probs.extend(row.probs)
        ends.append(len(ids))
    return DraftProbs(torch.tensor(ids, dtype=torch.long), torch.tensor(probs, dtype=torch.float32),
                      torch.tensor(ends, dtype=torch.long))
