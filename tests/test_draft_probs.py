"""DraftProbs (q of a proposal, sparse rows with offsets) and its wire codec: exact round trips, the dense
form equal to the math module's dense_q, batches concatenated row for row, and malformed rows refused
with INVALID_ARGUMENT naming the row and field."""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.core.errors import RequestError
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.spec_metadata import SpecDecodeMetadata
from specdec.math.rejection import dense_q
from specdec.math.sampling import truncate_top_n
from specdec.proto import common_pb2
from specdec.serving import draft_probs

V = 11


def rows_of(seed: int, k: int, top_n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    full = torch.rand(k, V, generator=gen).softmax(-1)
    return [truncate_top_n(full[i], top_n) for i in range(k)]


def test_dense_equals_the_math_modules_dense_q():
    rows = rows_of(0, 3)
    q = DraftProbs.from_rows(rows)
    assert q.num_rows == 3 and q.row_offsets.tolist() == [0, 4, 8, 12]
    assert torch.equal(q.dense(V), dense_q(rows, torch.zeros(3, dtype=torch.long), V))
    for i, (ids, probs) in enumerate(rows):
        assert torch.equal(q.row(i)[0], ids) and torch.equal(q.row(i)[1], probs)
    drafts = torch.tensor([3, 0, 7])
    assert torch.equal(DraftProbs.one_hot(drafts.tolist()).dense(V), dense_q(None, drafts, V))


def test_cat_keeps_every_row_in_order():
    a, b = DraftProbs.from_rows(rows_of(1, 2, top_n=3)), DraftProbs.one_hot([5, 6, 9])
    both = DraftProbs.cat([a, DraftProbs.empty(), b])
    assert both.num_rows == 5 and both.row_offsets.tolist() == [0, 3, 6, 7, 8, 9]
    assert torch.equal(both.dense(V), torch.cat([a.dense(V), b.dense(V)]))
    assert DraftProbs.cat([]).num_rows == 0 and DraftProbs.cat([]).dense(V).shape == (0, V)


def test_codec_round_trip_is_exact():
    q = DraftProbs.from_rows(rows_of(2, 4))
    wire = draft_probs.encode(q)
    assert len(wire) == 4 and all(len(r.token_ids) == len(r.probs) == 4 * 4 for r in wire)  # packed: 4 bytes a value
    back = draft_probs.decode(wire, 4, V)
    for field in ("token_ids", "probs", "row_offsets"):
        assert torch.equal(getattr(back, field), getattr(q, field)), field
    assert draft_probs.encode(None) == [] and draft_probs.decode([], 3, V) is None


@pytest.mark.parametrize("rows, message", [
    ([([1], [1.0])], "q has 1 rows but draft_tokens has 2"),
    ([([1], [1.0]), ([], [])], "q[1]: token_ids and probs must be non-empty"),
    ([([1], [1.0]), ([2, 3], [1.0])], "q[1]: token_ids and probs must be non-empty and of equal length"),
    ([([1], [1.0]), ([V], [1.0])], "q[1].token_ids: token id 11 is outside the vocabulary"),
    ([([1], [1.0]), ([2, 2], [0.5, 0.5])], "q[1].token_ids has duplicate ids"),
    ([([1], [1.0]), ([2, 3], [float("nan"), 1.0])], "q[1].probs must be finite and >= 0"),
    ([([1], [1.0]), ([2, 3], [0.2, 0.2])], "q[1].probs sum to 0.400000, not 1"),
])
def test_codec_refuses_malformed_rows(rows, message):
    wire = [draft_probs.row(ids, probs) for ids, probs in rows]
    with pytest.raises(RequestError) as e:
        draft_probs.decode(wire, 2, V)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message


def test_codec_refuses_bytes_that_are_not_whole_values():
    good = draft_probs.row([1], [1.0])
    for torn in (common_pb2.DraftDistribution(token_ids=b"\x01\x00\x00", probs=good.probs),
                 common_pb2.DraftDistribution(token_ids=good.token_ids, probs=good.probs[:-1])):
        with pytest.raises(RequestError) as e:
            draft_probs.decode([good, torn], 2, V)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "q[1]: token_ids and probs must be packed" in e.value.message


def test_spec_decode_metadata():
    meta = SpecDecodeMetadata.build([[4, 5], [], [7]], "cpu")
    assert meta.draft_token_ids.tolist() == [4, 5, 7]
    assert meta.cu_num_draft_tokens.tolist() == [0, 2, 2, 3] and meta.num_draft_tokens == [2, 0, 1]
