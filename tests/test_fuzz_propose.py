"""Fuzzing the draft tier's Propose and ProposeStream: generated requests, judged by the documented
rules, their proposals checked against the tiny draft run locally (the method: tests/fuzz_cases.py)."""

from __future__ import annotations

import math
import struct
import uuid

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.models import load_model
from specdec.proto import common_pb2, draft_pb2
from tests.fuzz_cases import (DRAFT_TOP_N, FUZZ_SETTINGS, GREEDY_T, INT32_MAX, INT32_MIN, INVALID, MAX_K, OK,
                              PRECONDITION, Q_TOL, RPC_TIMEOUT, SCALE, VOCAB, Verdict, assert_healthy_and_clean,
                              call_unary, check_context_len, check_ids, check_prefix, check_sampling, check_session_id,
                              describe, end_session, forget, model_logits, near_max)
from tests.fuzz_strategies import draw_context, draw_sampling, draw_session_id, seeds
from tests.helpers import device_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def draft_model(tiny_random_draft):
    return load_model(device_model(tiny_random_draft))  # on the draft tier's device, as its reference

def expect_propose(sid, ctx, k, request, held):
    """What the documented rules say a Propose must answer, and the committed sequence it implies."""
    v = Verdict()
    check_session_id(v, sid)
    check_prefix(v, ctx, held)
    if not ctx.new_tokens:
        v.refuse.append("empty new_tokens")
    check_ids(v, ctx.new_tokens, "new_tokens")
    if not 1 <= k <= MAX_K:
        v.refuse.append(f"num_tokens {k}")
    check_sampling(v, request.sampling)
    if 1 <= k <= MAX_K:
        check_context_len(v, ctx, k - 1)
    return v, (held or [])[: max(ctx.prefix_len, 0)] + list(ctx.new_tokens)

def check_proposal(resp: draft_pb2.ProposeResponse, request: draft_pb2.ProposeRequest, committed: list[int], draft_model) -> None:
    k, s, ctx = request.num_tokens, request.sampling, request.context
    assert len(resp.tokens) == k, f"{len(resp.tokens)} tokens for num_tokens={k}"
    assert all(0 <= t < VOCAB for t in resp.tokens), f"token out of range: {list(resp.tokens)}"
    greedy = s.temperature < GREEDY_T
    if greedy:
        assert len(resp.q) == 0, f"greedy proposal carries {len(resp.q)} q rows"
    else:
        assert len(resp.q) == k, f"sampled proposal carries {len(resp.q)} q rows for {k} tokens"
    for i, row in enumerate(resp.q):
        assert row.token_ids and len(row.token_ids) == len(row.probs) and not len(row.probs) % 4, f"q[{i}] empty, misaligned or torn"
        n = len(row.token_ids) // 4  # the wire: little-endian int32 ids, float32 probs (common.proto)
        ids, probs = struct.unpack(f"<{n}i", row.token_ids), struct.unpack(f"<{n}f", row.probs)
        assert len(set(ids)) == len(ids), f"q[{i}] has duplicate ids"
        assert all(0 <= t < VOCAB for t in ids), f"q[{i}] id out of range"
        assert all(math.isfinite(p) and p >= 0 for p in probs), f"q[{i}] has bad probs"
        assert abs(sum(probs) - 1.0) <= Q_TOL, f"q[{i}] sums to {sum(probs)}"
        assert len(ids) <= DRAFT_TOP_N, f"q[{i}] has {len(ids)} > draft_top_n entries"
        if 0 < s.top_k and len(ids) > s.top_k:  # only logits tied at the k-th keep more (transformers' top-k does too)
            assert sorted(probs, reverse=True)[s.top_k - 1] == min(probs), f"q[{i}] has {len(ids)} entries with top_k={s.top_k}"
        assert dict(zip(ids, probs)).get(resp.tokens[i], 0.0) > 0, f"token {i} was drawn outside its own q row"
    assert resp.cached_len == ctx.prefix_len + len(ctx.new_tokens) + k - 1, (
        f"cached_len {resp.cached_len} != {ctx.prefix_len} + {len(ctx.new_tokens)} + {k} - 1")
    if greedy or (s.top_k == 1 and s.temperature <= 1e4):
        tokens = list(resp.tokens)
        logits = model_logits(draft_model, committed + tokens[:-1], k)
        for i in range(k):
            assert near_max(logits[i], tokens[i]), (
                f"greedy proposal {i} is {tokens[i]}, the draft's argmax is {int(logits[i].argmax())}")


def test_fuzz_propose(cluster, draft_stub, draft_model, tiny_target_model):
    pool = [f"fuzz-propose-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    shadow: dict[str, list[int]] = {}
    tracked: set[str] = set()
    counts: dict[str, int] = {}

    @settings(max_examples=int(160 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        clean = data.draw(st.booleans(), label="clean")
        sid = draw_session_id(data, pool, clean)
        held = shadow.get(sid)
        k = data.draw(st.one_of(st.integers(1, MAX_K), st.integers(1, 4)) if clean else
                      st.one_of(st.integers(1, MAX_K), st.sampled_from([0, -1, MAX_K + 1, INT32_MAX, INT32_MIN])), label="num_tokens")
        ctx = draw_context(data, sid, held, extra=max(0, min(k, MAX_K) - 1), clean=clean)
        request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=draw_sampling(data, clean),
                                           seed=data.draw(seeds, label="seed"))
        v, committed = expect_propose(sid, ctx, k, request, held)

        if sid:
            tracked.add(sid)
        code, resp, details = call_unary(draft_stub.Propose, request)
        counts[code.name] = counts.get(code.name, 0) + 1
        if code == OK:
            if len(resp.tokens) == k:
                shadow[sid] = committed + list(resp.tokens[:-1])
            else:
                forget(shadow, draft_stub, sid)
        elif code not in (INVALID, PRECONDITION):
            forget(shadow, draft_stub, sid)
        assert code in v.allowed(), (
            f"Propose answered {code.name} ({details!r}); allowed {sorted(c.name for c in v.allowed())}; "
            f"refuse={v.refuse} maybe={v.maybe} precondition={v.precondition!r}\nrequest: {describe(request)}")
        if code != OK:
            return
        counts["reused prefix"] = counts.get("reused prefix", 0) + (ctx.prefix_len > 0)
        check_proposal(resp, request, committed, draft_model)
        if ctx.prefix_len > 0:  # the same proposal from scratch: draws are keyed by position, not state
            fresh = f"fuzz-replay-{uuid.uuid4().hex[:8]}"
            tracked.add(fresh)
            again = draft_stub.Propose(draft_pb2.ProposeRequest(
                context=common_pb2.SessionContext(session_id=fresh, new_tokens=committed), num_tokens=k,
                sampling=request.sampling, seed=request.seed), timeout=RPC_TIMEOUT)
            end_session(draft_stub, fresh)
            assert list(again.tokens) == list(resp.tokens), (
                f"resent from scratch, the proposal is {list(again.tokens)}, not {list(resp.tokens)} as on the cached prefix")
        if sid not in pool:
            assert end_session(draft_stub, sid) is True, "EndSession after an OK Propose must find the session"
            shadow.pop(sid, None)

    try:
        run()
    finally:
        print(f"\nPropose outcomes: {counts}")
    assert_healthy_and_clean(cluster, tiny_target_model, {"draft": tracked | set(pool)})


def test_fuzz_propose_stream(cluster, draft_stub, draft_model, tiny_target_model):
    """A stream of generated requests: one response per request, in order, until the first refused
    one, whose status ends the stream; sessions the stream touched are dropped when it ends."""
    counts: dict[str, int] = {}

    @settings(max_examples=int(50 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        pool = [f"fuzz-stream-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
        shadow: dict[str, list[int]] = {}
        plans = []  # (request, verdict, committed)
        n = data.draw(st.integers(1, 5), label="stream length")
        dirty_at = data.draw(st.integers(0, 6), label="dirty request")  # >= n: every request is clean
        # Requests are decided up front, assuming each earlier one succeeds as the shadow predicts.
        for i in range(n):
            clean = i != dirty_at
            sid = data.draw(st.sampled_from(pool), label="sid") if clean or data.draw(st.integers(0, 3)) else ""
            held = shadow.get(sid)
            k = data.draw(st.integers(1, 6) if clean else st.one_of(st.integers(1, 6), st.sampled_from([0, MAX_K + 1])),
                          label="num_tokens")
            ctx = draw_context(data, sid, held, extra=max(0, min(k, MAX_K) - 1), clean=clean, mismatch=False)
            request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=draw_sampling(data, clean), seed=data.draw(seeds))
            v, committed = expect_propose(sid, ctx, k, request, held)
            plans.append((request, v, committed))
            if v.allowed() != {OK}:
                break  # the stream ends at the first request that may fail
            # The tier will also cache this request's proposals but one; later requests are only
            # aimed at the committed part, which it certainly holds.
            shadow[sid] = committed
        responses = []
        code, details = OK, ""
        try:
            for r in draft_stub.ProposeStream(iter([p[0] for p in plans]), timeout=RPC_TIMEOUT):
                responses.append(r)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        counts[code.name] = counts.get(code.name, 0) + 1
        last_request, last_verdict, _ = plans[-1]
        n_ok = len(plans) if code == OK else len(plans) - 1
        assert len(responses) == n_ok, f"{len(responses)} responses for {len(plans)} requests ending {code.name} ({details!r})"
        allowed = last_verdict.allowed()
        assert code in allowed, (f"stream ended {code.name} ({details!r}) on its last request; allowed "
                                 f"{sorted(c.name for c in allowed)}; refuse={last_verdict.refuse} maybe={last_verdict.maybe} "
                                 f"precondition={last_verdict.precondition!r}\nrequest: {describe(last_request)}")
        for (request, _, committed), resp in zip(plans, responses):
            check_proposal(resp, request, committed, draft_model)

    try:
        run()
    finally:
        print(f"\nProposeStream outcomes: {counts}")
    # No EndSession here: the streams' ends must have dropped every session they touched.
    assert_healthy_and_clean(cluster, tiny_target_model, {})
