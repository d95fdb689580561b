"""Fuzzing the target tier's Verify: generated requests, judged by the documented rules, their results
checked against the tiny target run locally (the method: tests/fuzz_cases.py)."""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.proto import common_pb2, target_pb2
from tests.fuzz_cases import (FUZZ_SETTINGS, GREEDY_T, INVALID, MAX_CONTEXT, MAX_K, OK, PRECONDITION, RPC_TIMEOUT, SCALE,
                              VOCAB, Verdict, assert_healthy_and_clean, call_unary, check_context_len, check_ids,
                              check_prefix, check_q_rows, check_sampling, check_session_id, describe, end_session,
                              forget, greedy_chain, in_top_k, model_logits, near_max, q_row)
from tests.fuzz_strategies import bad_id, draw_context, draw_q, draw_sampling, draw_session_id, pick, seeds, valid_id

pytestmark = pytest.mark.slow


def test_fuzz_verify(cluster, target_stub, tiny_target_model):
    pool = [f"fuzz-verify-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    shadow: dict[str, list[int]] = {}  # session id -> tokens the target caches
    tracked: set[str] = set()
    counts: dict[str, int] = {}

    @settings(max_examples=int(160 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        clean = data.draw(st.booleans(), label="clean")
        sid = draw_session_id(data, pool, clean)
        held = shadow.get(sid)
        n_drafts = pick(data, clean, "drafts kind", (("none", 2), ("some", 6)), (("many", 1),))
        k = {"none": 0, "some": data.draw(st.integers(1, MAX_K)), "many": data.draw(st.integers(MAX_K + 1, 20))}[n_drafts]
        ctx = draw_context(data, sid, held, extra=k, clean=clean)
        drafts_kind = pick(data, clean, "drafts", (("random", 2), ("oracle", 4)), (("bad", 1),))
        drafts = data.draw(st.lists(valid_id, min_size=k, max_size=k), label="drafts")
        corrupt = data.draw(st.booleans(), label="corrupt oracle")
        corrupt_at = data.draw(st.integers(0, MAX_K), label="corrupt at")
        bump = data.draw(st.integers(1, 100), label="corrupt by")
        bad_at, bad = data.draw(st.integers(0, 20), label="bad draft at"), data.draw(bad_id, label="bad draft")
        committed = (held or [])[: max(ctx.prefix_len, 0)] + list(ctx.new_tokens)
        if drafts_kind == "oracle" and k and 0 < len(committed) < MAX_CONTEXT - k and all(0 <= t < VOCAB for t in committed) \
                and (ctx.prefix_len == 0 or (held is not None and ctx.prefix_len <= len(held))):
            drafts = greedy_chain(tiny_target_model, committed, k)  # the target's own choices: accepted
            if corrupt:
                j = corrupt_at % k
                drafts[j] = (drafts[j] + bump) % VOCAB
        if drafts_kind == "bad" and drafts:
            drafts[bad_at % len(drafts)] = bad
        q = draw_q(data, drafts, clean)
        request = target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, q=q, sampling=draw_sampling(data, clean),
                                           seed=data.draw(seeds, label="seed"))
        s = request.sampling

        v = Verdict()
        check_session_id(v, sid)
        check_prefix(v, ctx, held)
        if not ctx.new_tokens:
            v.refuse.append("empty new_tokens")
        check_ids(v, ctx.new_tokens, "new_tokens")
        if k > MAX_K:
            v.refuse.append(f"{k} drafts > {MAX_K}")
        check_ids(v, drafts, "draft_tokens")
        check_q_rows(v, q, k)
        check_sampling(v, s)
        check_context_len(v, ctx, k)

        if sid:
            tracked.add(sid)
        code, resp, details = call_unary(target_stub.Verify, request)
        counts[code.name] = counts.get(code.name, 0) + 1
        # Record what the target now caches before judging, so that the shadow stays exact.
        if code == OK and 0 <= resp.num_accepted <= k:
            shadow[sid] = committed + drafts[: resp.num_accepted]
        elif code == OK:
            forget(shadow, target_stub, sid)
        elif code not in (INVALID, PRECONDITION):
            forget(shadow, target_stub, sid)
        assert code in v.allowed(), (
            f"Verify answered {code.name} ({details!r}); allowed {sorted(c.name for c in v.allowed())}; "
            f"refuse={v.refuse} maybe={v.maybe} precondition={v.precondition!r}\nrequest: {describe(request)}")
        if code != OK:
            return
        n = resp.num_accepted
        counts["reused prefix"] = counts.get("reused prefix", 0) + (ctx.prefix_len > 0)
        counts["accepted > 0"] = counts.get("accepted > 0", 0) + (n > 0)
        assert 0 <= n <= k, f"num_accepted {n} outside [0, {k}]"
        assert 0 <= resp.next_token < VOCAB, f"next_token {resp.next_token}"
        assert resp.cached_len == ctx.prefix_len + len(ctx.new_tokens) + n, (
            f"cached_len {resp.cached_len} != {ctx.prefix_len} + {len(ctx.new_tokens)} + {n}")

        # The tokens themselves, against the target run locally over the same sequence.
        logits = model_logits(tiny_target_model, committed + drafts, k + 1)  # positions of d_1..d_K and the bonus
        greedy = s.temperature < GREEDY_T
        one_hot_p = greedy or (s.top_k == 1 and s.temperature <= 1e4)  # (a huge T can tie the scaled logits)
        q_d = [dict(zip(*q_row(r))).get(d, 0.0) for r, d in zip(q, drafts)] if q else [1.0] * k  # decoded, not bytes
        for i in range(n):
            assert q_d[i] > 0, f"draft {i} accepted although q_{i}(d_{i}) = 0"
            if one_hot_p:
                assert near_max(logits[i], drafts[i]), f"draft {i} ({drafts[i]}) accepted but is not the target's argmax"
            elif s.temperature <= 1e4:
                assert in_top_k(logits[i], drafts[i], s.top_k), f"draft {i} accepted outside top_k"
        if one_hot_p:
            assert near_max(logits[n], resp.next_token), (
                f"next_token {resp.next_token} is not the target's argmax {int(logits[n].argmax())} at position {n}")
            if greedy and not q and n < k:
                top = torch.topk(logits[n], 2)
                assert drafts[n] != int(top.indices[0]) or float(top.values[0] - top.values[1]) < 1e-3, (
                    f"greedy draft {n} ({drafts[n]}) is the target's argmax but was rejected")
        elif s.temperature <= 1e4:
            assert in_top_k(logits[n], resp.next_token, s.top_k), "next_token outside top_k"

        # Draws depend on the seed and the sequence, not on the tier's state: the same round on a fresh
        # session (the whole sequence resent, as after an eviction) has the same outcome.
        if ctx.prefix_len > 0:
            fresh = f"fuzz-replay-{uuid.uuid4().hex[:8]}"
            tracked.add(fresh)
            again = target_stub.Verify(target_pb2.VerifyRequest(
                context=common_pb2.SessionContext(session_id=fresh, new_tokens=committed), draft_tokens=drafts, q=q,
                sampling=s, seed=request.seed), timeout=RPC_TIMEOUT)
            end_session(target_stub, fresh)
            assert (again.num_accepted, again.next_token) == (n, resp.next_token), (
                f"resent from scratch, the round gives {(again.num_accepted, again.next_token)}, "
                f"not {(n, resp.next_token)} as on the cached prefix")
        if sid not in pool:  # keep the store small: only the pool's sessions persist across examples
            assert end_session(target_stub, sid) is True, "EndSession after an OK Verify must find the session"
            shadow.pop(sid, None)

    try:
        run()
    except BaseException:  # a failing example leaves no session behind on the cluster the next tests share
        for sid in tracked | set(pool):
            try:
                end_session(target_stub, sid)
            except grpc.RpcError:  # best effort: the example's own failure is the one to report
                pass
        raise
    finally:
        print(f"\nVerify outcomes: {counts}")
    assert_healthy_and_clean(cluster, tiny_target_model, {"target": tracked | set(pool)})
