"""Extreme input through the real gRPC servers: a message over the size limit gets RESOURCE_EXHAUSTED
on every service, which keeps serving on the same channel; a tiny but legal temperature is greedy
decoding (or refused naming temperature), never an internal error. (Shared limits and helpers:
tests/bad_input.py.)"""

from __future__ import annotations

import grpc
import pytest

from specdec.proto import common_pb2, generate_pb2, target_pb2
from specdec.serving import draft_probs
from tests.bad_input import (INVALID, MAX_MESSAGE, PROMPT, RPC_TIMEOUT, assert_status, ctx, end_session, generate_error,
                             generate_request, new_session_id, propose_request, unary_error, verify_request)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


# --- messages over the size limit -----------------------------------------------------------------

BIG = MAX_MESSAGE + 1024 * 1024  # ~9 MiB


def test_verify_message_too_large(target_stub):
    req = verify_request(context=ctx("v" * BIG))
    assert req.ByteSize() > MAX_MESSAGE
    err = unary_error(target_stub.Verify, req)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    # ...and a big q row list, the realistic way to overflow a Verify.
    n = BIG // 6
    row = draft_probs.row(range(n), [1.0 / n] * n)
    req = target_pb2.VerifyRequest(context=ctx("badinput-big-q"), draft_tokens=[5], q=[row], sampling=common_pb2.SamplingParams(temperature=1.0))
    assert req.ByteSize() > MAX_MESSAGE
    err = unary_error(target_stub.Verify, req)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    # The target keeps serving on the same channel.
    sid = new_session_id("after-big")
    try:
        resp = target_stub.Verify(verify_request(context=ctx(sid)), timeout=RPC_TIMEOUT)
        assert resp.cached_len == len(PROMPT) + resp.num_accepted
    finally:
        end_session(target_stub, sid)


def test_propose_message_too_large(draft_stub):
    err = unary_error(draft_stub.Propose, propose_request(context=ctx("p" * BIG)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    sid = new_session_id("after-big")
    try:
        assert len(draft_stub.Propose(propose_request(context=ctx(sid)), timeout=RPC_TIMEOUT).tokens) == 3
    finally:
        end_session(draft_stub, sid)


def test_generate_message_too_large(generation_stub):
    req = generate_pb2.GenerateRequest(text="g" * BIG, max_new_tokens=4)
    err = generate_error(generation_stub, req)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    events = list(generation_stub.Generate(generate_request(), timeout=RPC_TIMEOUT))
    assert events[-1].HasField("result")


# --- extreme but legal values: never an internal error ---------------------------------------------
# The protos allow any temperature >= 0. A tiny positive temperature (float32 subnormals included)
# must behave like greedy decoding (softmax(logits / T) -> one-hot on the argmax) or, if the server
# sets a documented minimum, be refused with INVALID_ARGUMENT naming temperature; never crash the
# sampler (UNKNOWN from a tier, INTERNAL from the coordinator).

TINY_TEMPERATURES = [1e-38, 1e-40, 1e-45]


def _ok_or_invalid_temperature(call, request, temperature: float):
    """The response, or None when refused with INVALID_ARGUMENT naming temperature."""
    try:
        return call(request, timeout=RPC_TIMEOUT)
    except grpc.RpcError as e:
        assert e.code() == INVALID, f"temperature={temperature!r} (legal: >= 0) crashed the server: {e.code().name}: {e.details()!r}"
        assert_status(e, INVALID, "temperature")
        return None


@pytest.mark.parametrize("k", [0, 3], ids=["target_only", "speculative"])
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_generate_tiny_temperature(generation_stub, temperature, k):
    greedy = list(generation_stub.Generate(generate_request(num_speculative_tokens=k, temperature=0.0), timeout=RPC_TIMEOUT))
    expected = [t for e in greedy if e.HasField("chunk") for t in e.chunk.token_ids]
    events = _ok_or_invalid_temperature(lambda r, timeout: list(generation_stub.Generate(r, timeout=timeout)),
                                        generate_request(num_speculative_tokens=k, temperature=temperature, seed=3), temperature)
    if events is not None:
        assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == expected, \
            "a near-zero temperature must reproduce greedy output"


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_propose_tiny_temperature(draft_stub, temperature):
    sid = new_session_id("draft-tiny-t")
    try:
        greedy = draft_stub.Propose(propose_request(context=ctx(sid)), timeout=RPC_TIMEOUT)
        resp = _ok_or_invalid_temperature(draft_stub.Propose, propose_request(context=ctx(sid), temperature=temperature, seed=3), temperature)
        if resp is not None:
            assert list(resp.tokens) == list(greedy.tokens)
            assert len(resp.q) == 0  # below GREEDY_TEMPERATURE a round is greedy: q is one-hot, not sent
    finally:
        end_session(draft_stub, sid)


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_verify_tiny_temperature(target_stub, temperature):
    sid = new_session_id("target-tiny-t")
    try:
        greedy = target_stub.Verify(verify_request(context=ctx(sid), draft_tokens=[]), timeout=RPC_TIMEOUT)
        resp = _ok_or_invalid_temperature(target_stub.Verify, verify_request(context=ctx(sid), draft_tokens=[], temperature=temperature, seed=3),
                                          temperature)
        if resp is not None:
            assert resp.next_token == greedy.next_token and resp.cached_len == len(PROMPT)
    finally:
        end_session(target_stub, sid)
