"""The wire codec of q: DraftProbs (specdec.engine.draft_probs) <-> repeated DraftDistribution rows
(common.proto), each row's ids and probabilities as packed little-endian bytes. encode() is the draft's: one
tobytes() per row and field. decode() is the target's: it reads the bytes with numpy.frombuffer and checks
everything that arrives, vectorized, each failure an INVALID_ARGUMENT naming the row and field, before any
work is queued."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.core.errors import invalid_argument
from specdec.engine.draft_probs import DraftProbs
from specdec.proto import common_pb2

Q_SUM_TOLERANCE = 1e-3  # a q row must sum to 1 within this
ID_DTYPE, PROB_DTYPE = np.dtype("<i4"), np.dtype("<f4")  # the wire's int32 ids and float32 probabilities


def row(token_ids: Sequence[int], probs: Sequence[float]) -> common_pb2.DraftDistribution:
    """One row from Python values (tests, hand-made requests; the draft encodes from its tensors)."""
    return common_pb2.DraftDistribution(token_ids=np.asarray(token_ids, ID_DTYPE).tobytes(),
                                        probs=np.asarray(probs, PROB_DTYPE).tobytes())


def encode(q: DraftProbs | None) -> list[common_pb2.DraftDistribution]:
    """One DraftDistribution per row; none for None (q one-hot on the drafts: nothing to send)."""
    if q is None:
        return []
    ids = q.token_ids.numpy().astype(ID_DTYPE)
    probs = q.probs.numpy().astype(PROB_DTYPE, copy=False)
    ends = q.row_offsets.tolist()
    return [common_pb2.DraftDistribution(token_ids=ids[a:b].tobytes(), probs=probs[a:b].tobytes())
            for a, b in zip(ends, ends[1:])]


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
    for i, r in enumerate(rows):  # the shapes, row by row (no element is looked at here)
        if len(r.token_ids) % ID_DTYPE.itemsize or len(r.probs) % PROB_DTYPE.itemsize:
            raise invalid_argument(f"{field_name}[{i}]: token_ids and probs must be packed 4-byte values")
        if not r.token_ids or len(r.token_ids) != len(r.probs):
            raise invalid_argument(f"{field_name}[{i}]: token_ids and probs must be non-empty and of equal length")
    # Then every row at once: the values checked with one numpy pass each, a failure traced to its row.
    ids = np.frombuffer(b"".join(r.token_ids for r in rows), ID_DTYPE).astype(np.int64)  # [E]
    probs = np.frombuffer(b"".join(r.probs for r in rows), PROB_DTYPE).copy()  # [E]
    ends = np.cumsum([0] + [len(r.token_ids) // ID_DTYPE.itemsize for r in rows])  # [R + 1]
    row_of = np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(ends))  # [E]: the row of each element

    def fail(mask: np.ndarray, what) -> None:
        j = int(np.argmax(mask))  # the first failing element, in row order
        raise invalid_argument(f"{field_name}[{int(row_of[j])}].{what(j)}")

    if (outside := (ids < 0) | (ids >= vocab_size)).any():
        fail(outside, lambda j: f"token_ids: token id {int(ids[j])} is outside the vocabulary [0, {vocab_size})")
    keys = np.sort(row_of * vocab_size + ids)  # distinct within each row = distinct (row, id) pairs
    if (repeated := keys[1:] == keys[:-1]).any():
        raise invalid_argument(f"{field_name}[{int(keys[int(np.argmax(repeated))] // vocab_size)}].token_ids has duplicate ids")
    if (bad := ~(np.isfinite(probs) & (probs >= 0))).any():
        fail(bad, lambda j: f"probs must be finite and >= 0, got {float(probs[j])}")
    totals = np.add.reduceat(probs.astype(np.float64), ends[:-1])  # [R]
    if (off := np.abs(totals - 1.0) > Q_SUM_TOLERANCE).any():
        i = int(np.argmax(off))
        raise invalid_argument(f"{field_name}[{i}].probs sum to {totals[i]:.6f}, not 1")
    return DraftProbs(torch.from_numpy(ids), torch.from_numpy(probs), torch.from_numpy(ends.astype(np.int64)))
