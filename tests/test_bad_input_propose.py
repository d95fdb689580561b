"""Bad input to the draft tier's Propose and ProposeStream through the real gRPC servers: malformed
requests get INVALID_ARGUMENT naming the field, an unknown session or a wrong prefix FAILED_PRECONDITION
(and creates or breaks no session), and an error ends a stream after exactly the valid requests before
it were answered, dropping the stream's sessions. (Shared limits and helpers: tests/bad_input.py.)"""

from __future__ import annotations

import math
import time

import grpc
import pytest

from specdec.proto import draft_pb2
from tests.bad_input import (INVALID, MAX_CONTEXT, MAX_K, PRECONDITION, PROMPT, RPC_TIMEOUT, VOCAB, assert_status, ctx,
                             end_session, new_session_id, prefix_hash, propose_request, unary_error)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


PROPOSE_INVALID_CASES = [
    ("num_tokens_0", lambda: propose_request(num_tokens=0), ["num_tokens", "0"]),
    ("num_tokens_negative", lambda: propose_request(num_tokens=-1), ["num_tokens", "-1"]),
    ("num_tokens_above_cap", lambda: propose_request(num_tokens=MAX_K + 1), ["num_tokens", str(MAX_K + 1)]),
    ("missing_context", lambda: draft_pb2.ProposeRequest(num_tokens=3), ["session_id"]),
    ("missing_session_id", lambda: propose_request(context=ctx("")), ["session_id"]),
    ("session_id_too_long", lambda: propose_request(context=ctx("s" * 129)), ["session_id"]),
    ("negative_prefix_len", lambda: propose_request(context=ctx("badinput-draft-invalid", prefix_len=-1)), ["prefix_len", "-1"]),
    ("empty_new_tokens", lambda: propose_request(context=ctx("badinput-draft-invalid", new_tokens=[])), ["new_tokens"]),
    ("new_token_out_of_vocab", lambda: propose_request(context=ctx("badinput-draft-invalid", new_tokens=[1, VOCAB])),
     ["new_tokens", str(VOCAB)]),
    ("new_token_negative", lambda: propose_request(context=ctx("badinput-draft-invalid", new_tokens=[1, -3])), ["new_tokens", "-3"]),
    ("context_too_long", lambda: propose_request(context=ctx("badinput-draft-invalid", new_tokens=[1] * (MAX_CONTEXT + 6))),
     ["context"]),
    ("temperature_negative", lambda: propose_request(temperature=-0.5), ["temperature"]),
    ("temperature_nan", lambda: propose_request(temperature=math.nan), ["temperature"]),
    ("top_k_negative", lambda: propose_request(top_k=-1), ["top_k"]),
    ("top_p_above_1", lambda: propose_request(top_p=1.5), ["top_p"]),
    ("top_p_negative", lambda: propose_request(top_p=-0.5), ["top_p"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in PROPOSE_INVALID_CASES], ids=[c[0] for c in PROPOSE_INVALID_CASES])
def test_propose_invalid_argument(draft_stub, build, words):
    err = unary_error(draft_stub.Propose, build())
    assert_status(err, INVALID, *words)


def test_propose_unknown_session_failed_precondition(draft_stub):
    sid = new_session_id("draft-unknown")
    err = unary_error(draft_stub.Propose, propose_request(context=ctx(sid, prefix_len=2, prefix_hash=prefix_hash(PROMPT[:2]),
                                                              new_tokens=PROMPT[2:])))
    assert_status(err, PRECONDITION, sid)
    assert end_session(draft_stub, sid) is False, "a rejected request must not create a session"


def test_propose_prefix_mismatch_failed_precondition(draft_stub):
    sid = new_session_id("draft-prefix")
    try:
        first = draft_stub.Propose(propose_request(context=ctx(sid)), timeout=RPC_TIMEOUT)
        assert len(first.tokens) == 3 and all(0 <= t < VOCAB for t in first.tokens)
        assert len(first.q) == 0  # greedy
        assert first.cached_len == len(PROMPT) + 3 - 1

        # Right prefix_len, wrong fingerprint.
        good = prefix_hash(PROMPT)
        bad = propose_request(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good ^ 1, new_tokens=[first.tokens[0]]))
        assert_status(unary_error(draft_stub.Propose, bad), PRECONDITION, "prefix")

        # prefix_len beyond what the session holds.
        too_long = first.cached_len + 10
        bad = propose_request(context=ctx(sid, prefix_len=too_long, prefix_hash=good, new_tokens=[5]))
        assert_status(unary_error(draft_stub.Propose, bad), PRECONDITION, "prefix_len", str(too_long))

        # The session is still usable with the right prefix.
        ok = draft_stub.Propose(propose_request(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good,
                                                     new_tokens=[first.tokens[0]])), timeout=RPC_TIMEOUT)
        assert ok.tokens[0] == first.tokens[1], "greedy proposal must continue deterministically"
        assert ok.cached_len == len(PROMPT) + 1 + 3 - 1
    finally:
        end_session(draft_stub, sid)


STREAM_INVALID_CASES = [
    ("num_tokens_0", lambda sid: propose_request(context=ctx(sid), num_tokens=0), INVALID, ["num_tokens"]),
    ("num_tokens_above_cap", lambda sid: propose_request(context=ctx(sid), num_tokens=MAX_K + 1), INVALID, ["num_tokens"]),
    ("missing_session_id", lambda sid: propose_request(context=ctx("")), INVALID, ["session_id"]),
    ("token_out_of_vocab", lambda sid: propose_request(context=ctx(sid, new_tokens=[VOCAB + 5])), INVALID, ["new_tokens"]),
    ("top_p_above_1", lambda sid: propose_request(context=ctx(sid), top_p=1.5), INVALID, ["top_p"]),
    ("unknown_session", lambda sid: propose_request(context=ctx(sid, prefix_len=2, new_tokens=[5])), PRECONDITION, ["{sid}"]),
]


@pytest.mark.parametrize("valid_first", [False, True], ids=["first_request", "after_valid_request"])
@pytest.mark.parametrize("build, code, words", [c[1:] for c in STREAM_INVALID_CASES], ids=[c[0] for c in STREAM_INVALID_CASES])
def test_propose_stream_error_ends_stream(draft_stub, build, code, words, valid_first):
    sid = new_session_id("stream")
    bad_sid = sid + "-other" if valid_first else sid  # a fresh id for the bad request, so 'unknown session' is true
    requests = ([propose_request(context=ctx(sid))] if valid_first else []) + [build(bad_sid), propose_request(context=ctx(sid + "-never"))]
    responses = []
    try:
        with pytest.raises(grpc.RpcError) as ei:
            for response in draft_stub.ProposeStream(iter(requests), timeout=RPC_TIMEOUT):
                responses.append(response)
        assert len(responses) == (1 if valid_first else 0), "exactly the valid requests before the bad one are answered"
        assert_status(ei.value, code, *(w.format(sid=bad_sid) for w in words))
        if valid_first:
            # The stream pinned the first request's session; its end must drop it (asynchronously).
            probe = propose_request(context=ctx(sid, prefix_len=1, prefix_hash=prefix_hash(PROMPT[:1]), new_tokens=PROMPT[1:]))
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    draft_stub.Propose(probe, timeout=RPC_TIMEOUT)
                except grpc.RpcError as e:
                    assert_status(e, PRECONDITION, sid)
                    break
                assert time.monotonic() < deadline, f"session {sid} still cached 5 s after its stream ended"
                time.sleep(0.1)
    finally:
        for s in (sid, bad_sid, sid + "-never"):
            end_session(draft_stub, s)
