"""Bad input to the target tier's Verify through the real gRPC servers: malformed drafts and q rows get
INVALID_ARGUMENT naming the field (q[i] and its probs included), an unknown session or a wrong prefix
FAILED_PRECONDITION, and a session that refused a wrong prefix still verifies with the right one.
(Shared limits and helpers: tests/bad_input.py.)"""

from __future__ import annotations

import math

import pytest

from specdec.proto import common_pb2, target_pb2
from specdec.serving import draft_probs
from tests.bad_input import (INVALID, MAX_CONTEXT, MAX_K, PRECONDITION, PROMPT, RPC_TIMEOUT, VOCAB, assert_status, ctx,
                             end_session, new_session_id, prefix_hash, unary_error, verify_request)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


def _row(ids, probs) -> common_pb2.DraftDistribution:
    return draft_probs.row(ids, probs)


GOOD_ROW = ([5, 6], [0.25, 0.75])


def _verify_q(*rows):
    return verify_request(q=[_row(*r) for r in rows], temperature=1.0)


VERIFY_INVALID_CASES = [
    ("draft_tokens_above_cap", lambda: verify_request(draft_tokens=[5] * (MAX_K + 1)), ["draft_tokens", str(MAX_K + 1)]),
    ("q_fewer_rows_than_drafts", lambda: _verify_q(GOOD_ROW), ["q", "draft_tokens"]),
    ("q_more_rows_than_drafts", lambda: _verify_q(GOOD_ROW, GOOD_ROW, GOOD_ROW), ["q", "draft_tokens"]),
    ("q_rows_without_drafts", lambda: verify_request(draft_tokens=[], q=[_row(*GOOD_ROW)], temperature=1.0), ["q", "draft_tokens"]),
    ("q_row_length_mismatch", lambda: _verify_q(GOOD_ROW, ([5, 6, 7], [0.5, 0.5])), ["q[1]"]),
    ("q_row_empty", lambda: _verify_q(([], []), GOOD_ROW), ["q[0]"]),
    ("q_duplicate_ids", lambda: _verify_q(([5, 5], [0.5, 0.5]), GOOD_ROW), ["q[0]", "duplicate"]),
    ("q_negative_prob", lambda: _verify_q(([5, 6], [1.5, -0.5]), GOOD_ROW), ["q[0].probs"]),
    ("q_nan_prob", lambda: _verify_q(GOOD_ROW, ([5, 6], [math.nan, 1.0])), ["q[1].probs"]),
    ("q_inf_prob", lambda: _verify_q(GOOD_ROW, ([5, 6], [math.inf, 0.0])), ["q[1].probs"]),
    ("q_probs_sum_below_1", lambda: _verify_q(([5, 6], [0.25, 0.5]), GOOD_ROW), ["q[0].probs"]),
    ("q_probs_sum_above_1", lambda: _verify_q(GOOD_ROW, ([5, 6], [0.75, 0.75])), ["q[1].probs"]),
    ("q_token_out_of_vocab", lambda: _verify_q(([5, VOCAB], [0.5, 0.5]), GOOD_ROW), ["q[0].token_ids", str(VOCAB)]),
    ("q_token_negative", lambda: _verify_q(GOOD_ROW, ([-1, 6], [0.5, 0.5])), ["q[1].token_ids", "-1"]),
    ("draft_token_out_of_vocab", lambda: verify_request(draft_tokens=[5, VOCAB]), ["draft_tokens", str(VOCAB)]),
    ("draft_token_negative", lambda: verify_request(draft_tokens=[-7]), ["draft_tokens", "-7"]),
    ("context_too_long", lambda: verify_request(context=ctx("badinput-target-invalid", new_tokens=[1] * 1030)), ["context"]),
    ("context_plus_drafts_too_long",
     lambda: verify_request(context=ctx("badinput-target-invalid", new_tokens=[1] * (MAX_CONTEXT - 1)), draft_tokens=[5, 6]),
     ["context"]),
    ("missing_context", lambda: target_pb2.VerifyRequest(draft_tokens=[5]), ["session_id"]),
    ("missing_session_id", lambda: verify_request(context=ctx("")), ["session_id"]),
    ("session_id_too_long", lambda: verify_request(context=ctx("t" * 129)), ["session_id"]),
    ("negative_prefix_len", lambda: verify_request(context=ctx("badinput-target-invalid", prefix_len=-2)), ["prefix_len"]),
    ("empty_new_tokens", lambda: verify_request(context=ctx("badinput-target-invalid", new_tokens=[])), ["new_tokens"]),
    ("new_token_out_of_vocab", lambda: verify_request(context=ctx("badinput-target-invalid", new_tokens=[VOCAB + 100])),
     ["new_tokens", str(VOCAB + 100)]),
    ("temperature_negative", lambda: verify_request(temperature=-1.0), ["temperature"]),
    ("temperature_nan", lambda: verify_request(temperature=math.nan), ["temperature"]),
    ("top_k_negative", lambda: verify_request(top_k=-4), ["top_k"]),
    ("top_p_above_1", lambda: verify_request(top_p=1.5), ["top_p"]),
    ("top_p_nan", lambda: verify_request(top_p=math.nan), ["top_p"]),
    ("run_on_with_masks", lambda: _run_on(verify_request(draft_tokens=[]), 3, masks=[b"\xff" * 8]),
     ["run_on_seeds", "token_masks"]),
    ("run_on_with_features", lambda: _run_on(verify_request(draft_tokens=[]), 3, layers=[0]),
     ["run_on_seeds", "feature_layers"]),
    ("run_on_above_cap", lambda: _run_on(verify_request(draft_tokens=[]), 65), ["run_on_seeds", "64", "65"]),
    ("run_on_part_negative", lambda: _parted(_run_on(verify_request(draft_tokens=[]), 3), -2), ["run_on_part", "-2"]),
    ("q_with_race_seed", lambda: _raced(_verify_q(GOOD_ROW, GOOD_ROW)), ["q", "race_seed"]),
]


def _raced(request: target_pb2.VerifyRequest) -> target_pb2.VerifyRequest:
    request.race_seed = 12345
    return request


def _parted(request: target_pb2.VerifyRequest, part: int) -> target_pb2.VerifyRequest:
    request.run_on_part = part
    return request


def _run_on(request: target_pb2.VerifyRequest, n: int, masks=(), layers=()) -> target_pb2.VerifyRequest:
    """The request with n run-on seeds (and structured-output masks or feature layers)."""
    request.run_on_seeds.extend(range(n))
    request.token_masks.extend(masks)
    request.feature_layers.extend(layers)
    return request


@pytest.mark.parametrize("build, words", [c[1:] for c in VERIFY_INVALID_CASES], ids=[c[0] for c in VERIFY_INVALID_CASES])
def test_verify_invalid_argument(target_stub, build, words):
    err = unary_error(target_stub.Verify, build())
    assert_status(err, INVALID, *words)


def test_verify_unknown_session_failed_precondition(target_stub):
    sid = new_session_id("target-unknown")
    err = unary_error(target_stub.Verify, verify_request(context=ctx(sid, prefix_len=2, prefix_hash=prefix_hash(PROMPT[:2]),
                                                              new_tokens=PROMPT[2:])))
    assert_status(err, PRECONDITION, sid)
    assert end_session(target_stub, sid) is False, "a rejected request must not create a session"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy_empty_q", "sampled_with_q"])
def test_verify_valid_then_prefix_mismatch(target_stub, sampled):
    sid = new_session_id("target-valid")
    try:
        if sampled:
            req = verify_request(context=ctx(sid), q=[_row(*GOOD_ROW), _row([6, 7, 8], [0.2, 0.3, 0.5])], temperature=1.0)
        else:
            req = verify_request(context=ctx(sid))
        resp = target_stub.Verify(req, timeout=RPC_TIMEOUT)
        n = resp.num_accepted
        assert 0 <= n <= 2
        assert 0 <= resp.next_token < VOCAB
        assert resp.cached_len == len(PROMPT) + n

        # The session now holds PROMPT + n accepted drafts: a wrong fingerprint or a longer prefix is refused.
        good = prefix_hash(PROMPT)
        bad = verify_request(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good ^ 0xFF, new_tokens=[resp.next_token]))
        assert_status(unary_error(target_stub.Verify, bad), PRECONDITION, "prefix")
        too_long = resp.cached_len + 5
        bad = verify_request(context=ctx(sid, prefix_len=too_long, prefix_hash=good, new_tokens=[resp.next_token]))
        assert_status(unary_error(target_stub.Verify, bad), PRECONDITION, "prefix_len", str(too_long))

        # ...and the right prefix still works.
        again = target_stub.Verify(verify_request(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good, new_tokens=[resp.next_token]),
                                           draft_tokens=[]), timeout=RPC_TIMEOUT)
        assert again.num_accepted == 0 and again.cached_len == len(PROMPT) + 1
    finally:
        assert end_session(target_stub, sid) is True
