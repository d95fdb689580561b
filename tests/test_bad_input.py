"""Bad input through the real gRPC servers: every malformed request gets the right status code and a
message naming the offending field, before any work is done, and the servers stay healthy.

Raw stubs over grpc.insecure_channel are used (not specdec.client) so any value can be sent.
The last test in this file (test_zz_servers_healthy_after_bad_input) checks that, after everything
above it, the servers still generate, answer the standard health check and hold no leftover
sessions; pytest runs tests in file order, so keep it last.
"""

from __future__ import annotations

import math
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.serving import draft_probs

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

VOCAB = 49152  # SmolLM2 tokenizer, the tiny models' logits width
MAX_CONTEXT = 1024  # tiny models' max_position_embeddings
MAX_K = 16  # tiers' max_draft_tokens and the coordinator's max K
MAX_NEW_CAP = 4096  # CoordinatorConfig.max_new_tokens_cap default
MAX_PROMPT = 8192  # CoordinatorConfig.max_prompt_tokens default
MAX_MESSAGE = 8 * 1024 * 1024  # ServerConfig.max_message_bytes default
EOS = 2
PROMPT = [1, 2000, 3000]
RPC_TIMEOUT = 30
SESSION_PREFIX = "badinput-"

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def _sid(tag: str) -> str:
    return f"{SESSION_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"


# --- fixtures -------------------------------------------------------------------------------------






# --- helpers --------------------------------------------------------------------------------------


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, *words: str) -> None:
    """err has `code` and its message mentions every word (case-insensitive)."""
    details = err.details() or ""
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {details!r}"
    for w in words:
        assert w.lower() in details.lower(), f"message {details!r} does not mention {w!r}"


def unary_error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        call(request, timeout=RPC_TIMEOUT)
    return ei.value


def generate_error(stub, request: generate_pb2.GenerateRequest) -> grpc.RpcError:
    """Iterate the Generate stream; the error must come before any event is streamed."""
    events = []
    with pytest.raises(grpc.RpcError) as ei:
        for event in stub.Generate(request, timeout=RPC_TIMEOUT):
            events.append(event)
    assert events == [], f"{len(events)} event(s) were streamed before the error"
    return ei.value


def ctx(session_id: str = "", prefix_len: int = 0, new_tokens=PROMPT, prefix_hash: int = 0) -> common_pb2.SessionContext:
    return common_pb2.SessionContext(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash,
                                     new_tokens=list(new_tokens))


def prefix_hash(tokens) -> int:
    return PrefixHashes(tokens).at(len(tokens))


def end_session(stub, session_id: str) -> bool:
    return stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT).existed


# --- 1. coordinator Generate ----------------------------------------------------------------------


def _gen(**fields) -> generate_pb2.GenerateRequest:
    """A valid small request (token ids prompt, 4 tokens, greedy) with `fields` overriding it."""
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.token_ids.ids.extend(PROMPT)
    for name, value in fields.items():
        if name == "stop":
            req.stop.extend(value)
        else:
            setattr(req, name, value)
    return req


def _no_prompt():
    return generate_pb2.GenerateRequest(max_new_tokens=4)


def _empty_text():
    req = generate_pb2.GenerateRequest(text="", max_new_tokens=4)
    assert req.WhichOneof("prompt") == "text"
    return req


def _empty_chat():
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.chat.SetInParent()
    assert req.WhichOneof("prompt") == "chat"
    return req


def _chat_role(role: str):
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.chat.messages.add(role="user", content="Hello")
    req.chat.messages.add(role=role, content="Hi there")
    return req


def _empty_token_ids():
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.token_ids.SetInParent()
    assert req.WhichOneof("prompt") == "token_ids"
    return req


def _token_ids(ids):
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.token_ids.ids.extend(ids)
    return req


GENERATE_CASES = [
    # (id, request builder, words the message must mention)
    ("no_prompt", _no_prompt, ["prompt"]),
    ("empty_text", _empty_text, ["text"]),
    ("empty_chat_messages", _empty_chat, ["chat.messages"]),
    ("chat_unknown_role", lambda: _chat_role("robot"), ["chat.messages[1].role", "robot"]),
    ("chat_empty_role", lambda: _chat_role(""), ["chat.messages[1].role"]),
    ("empty_token_ids", _empty_token_ids, ["token_ids"]),
    ("token_id_negative", lambda: _token_ids([1, -1, 3000]), ["token_ids", "-1"]),
    ("token_id_out_of_vocab", lambda: _token_ids([1, VOCAB, 3000]), ["token_ids", str(VOCAB)]),
    ("token_ids_too_long", lambda: _token_ids([1] + [2000] * MAX_PROMPT), ["max_prompt_tokens"]),
    ("text_too_long", lambda: generate_pb2.GenerateRequest(text="hello " * (MAX_PROMPT + 10), max_new_tokens=4),
     ["max_prompt_tokens"]),
    ("max_new_tokens_0", lambda: _gen(max_new_tokens=0), ["max_new_tokens"]),
    ("max_new_tokens_negative", lambda: _gen(max_new_tokens=-5), ["max_new_tokens", "-5"]),
    ("max_new_tokens_above_cap", lambda: _gen(max_new_tokens=MAX_NEW_CAP + 1), ["max_new_tokens", str(MAX_NEW_CAP + 1)]),
    ("temperature_negative", lambda: _gen(temperature=-0.1), ["temperature"]),
    ("temperature_nan", lambda: _gen(temperature=math.nan), ["temperature"]),
    ("temperature_inf", lambda: _gen(temperature=math.inf), ["temperature"]),
    ("top_k_negative", lambda: _gen(top_k=-1), ["top_k"]),
    ("top_p_zero_explicit", lambda: _gen(top_p=0.0), ["top_p"]),
    ("top_p_negative", lambda: _gen(top_p=-0.5), ["top_p"]),
    ("top_p_above_1", lambda: _gen(top_p=1.5), ["top_p"]),
    ("top_p_nan", lambda: _gen(top_p=math.nan), ["top_p"]),
    ("num_speculative_tokens_negative", lambda: _gen(num_speculative_tokens=-1), ["num_speculative_tokens"]),
    ("num_speculative_tokens_above_cap", lambda: _gen(num_speculative_tokens=MAX_K + 1), ["num_speculative_tokens"]),
    ("num_speculative_nodes_negative", lambda: _gen(num_speculative_nodes=-1), ["num_speculative_nodes", "-1"]),
    ("num_speculative_nodes_above_cap", lambda: _gen(num_speculative_nodes=MAX_K + 1), ["num_speculative_nodes"]),
    ("num_speculative_nodes_below_k", lambda: _gen(num_speculative_tokens=4, num_speculative_nodes=3),
     ["num_speculative_nodes (3)", "at least num_speculative_tokens (4)"]),
    ("num_speculative_nodes_penalised", lambda: _gen(num_speculative_nodes=6, presence_penalty=0.5),
     ["num_speculative_nodes", "penalty"]),
    ("too_many_stop_strings", lambda: _gen(stop=[f"s{i}" for i in range(17)]), ["stop"]),
    ("empty_stop_string", lambda: _gen(stop=["ok", ""]), ["stop"]),
    ("stop_string_too_long", lambda: _gen(stop=["x" * 257]), ["stop"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES])
def test_generate_invalid_argument(generation_stub, build, words):
    err = generate_error(generation_stub, build())
    assert_status(err, INVALID, *words)


def test_generate_valid_baseline(generation_stub):
    """The request the invalid cases are mutations of is itself accepted."""
    events = list(generation_stub.Generate(_gen(), timeout=RPC_TIMEOUT))
    assert events and events[-1].HasField("result")
    ids = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    assert 1 <= len(ids) <= 4


# --- 2. draft Propose / ProposeStream -------------------------------------------------------------


def _propose(session_id="badinput-draft-invalid", context=None, num_tokens=3, temperature=0.0, top_k=0, top_p=0.0, seed=7):
    return draft_pb2.ProposeRequest(
        context=context if context is not None else ctx(session_id),
        num_tokens=num_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
    )


PROPOSE_INVALID_CASES = [
    ("num_tokens_0", lambda: _propose(num_tokens=0), ["num_tokens", "0"]),
    ("num_tokens_negative", lambda: _propose(num_tokens=-1), ["num_tokens", "-1"]),
    ("num_tokens_above_cap", lambda: _propose(num_tokens=MAX_K + 1), ["num_tokens", str(MAX_K + 1)]),
    ("missing_context", lambda: draft_pb2.ProposeRequest(num_tokens=3), ["session_id"]),
    ("missing_session_id", lambda: _propose(context=ctx("")), ["session_id"]),
    ("session_id_too_long", lambda: _propose(context=ctx("s" * 129)), ["session_id"]),
    ("negative_prefix_len", lambda: _propose(context=ctx("badinput-draft-invalid", prefix_len=-1)), ["prefix_len", "-1"]),
    ("empty_new_tokens", lambda: _propose(context=ctx("badinput-draft-invalid", new_tokens=[])), ["new_tokens"]),
    ("new_token_out_of_vocab", lambda: _propose(context=ctx("badinput-draft-invalid", new_tokens=[1, VOCAB])),
     ["new_tokens", str(VOCAB)]),
    ("new_token_negative", lambda: _propose(context=ctx("badinput-draft-invalid", new_tokens=[1, -3])), ["new_tokens", "-3"]),
    ("context_too_long", lambda: _propose(context=ctx("badinput-draft-invalid", new_tokens=[1] * (MAX_CONTEXT + 6))),
     ["context"]),
    ("temperature_negative", lambda: _propose(temperature=-0.5), ["temperature"]),
    ("temperature_nan", lambda: _propose(temperature=math.nan), ["temperature"]),
    ("top_k_negative", lambda: _propose(top_k=-1), ["top_k"]),
    ("top_p_above_1", lambda: _propose(top_p=1.5), ["top_p"]),
    ("top_p_negative", lambda: _propose(top_p=-0.5), ["top_p"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in PROPOSE_INVALID_CASES], ids=[c[0] for c in PROPOSE_INVALID_CASES])
def test_propose_invalid_argument(draft_stub, build, words):
    err = unary_error(draft_stub.Propose, build())
    assert_status(err, INVALID, *words)


def test_propose_unknown_session_failed_precondition(draft_stub):
    sid = _sid("draft-unknown")
    err = unary_error(draft_stub.Propose, _propose(context=ctx(sid, prefix_len=2, prefix_hash=prefix_hash(PROMPT[:2]),
                                                              new_tokens=PROMPT[2:])))
    assert_status(err, PRECONDITION, sid)
    assert end_session(draft_stub, sid) is False, "a rejected request must not create a session"


def test_propose_prefix_mismatch_failed_precondition(draft_stub):
    sid = _sid("draft-prefix")
    try:
        first = draft_stub.Propose(_propose(context=ctx(sid)), timeout=RPC_TIMEOUT)
        assert len(first.tokens) == 3 and all(0 <= t < VOCAB for t in first.tokens)
        assert len(first.q) == 0  # greedy
        assert first.cached_len == len(PROMPT) + 3 - 1

        # Right prefix_len, wrong fingerprint.
        good = prefix_hash(PROMPT)
        bad = _propose(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good ^ 1, new_tokens=[first.tokens[0]]))
        assert_status(unary_error(draft_stub.Propose, bad), PRECONDITION, "prefix")

        # prefix_len beyond what the session holds.
        too_long = first.cached_len + 10
        bad = _propose(context=ctx(sid, prefix_len=too_long, prefix_hash=good, new_tokens=[5]))
        assert_status(unary_error(draft_stub.Propose, bad), PRECONDITION, "prefix_len", str(too_long))

        # The session is still usable with the right prefix.
        ok = draft_stub.Propose(_propose(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good,
                                                     new_tokens=[first.tokens[0]])), timeout=RPC_TIMEOUT)
        assert ok.tokens[0] == first.tokens[1], "greedy proposal must continue deterministically"
        assert ok.cached_len == len(PROMPT) + 1 + 3 - 1
    finally:
        end_session(draft_stub, sid)


STREAM_INVALID_CASES = [
    ("num_tokens_0", lambda sid: _propose(context=ctx(sid), num_tokens=0), INVALID, ["num_tokens"]),
    ("num_tokens_above_cap", lambda sid: _propose(context=ctx(sid), num_tokens=MAX_K + 1), INVALID, ["num_tokens"]),
    ("missing_session_id", lambda sid: _propose(context=ctx("")), INVALID, ["session_id"]),
    ("token_out_of_vocab", lambda sid: _propose(context=ctx(sid, new_tokens=[VOCAB + 5])), INVALID, ["new_tokens"]),
    ("top_p_above_1", lambda sid: _propose(context=ctx(sid), top_p=1.5), INVALID, ["top_p"]),
    ("unknown_session", lambda sid: _propose(context=ctx(sid, prefix_len=2, new_tokens=[5])), PRECONDITION, ["{sid}"]),
]


@pytest.mark.parametrize("valid_first", [False, True], ids=["first_request", "after_valid_request"])
@pytest.mark.parametrize("build, code, words", [c[1:] for c in STREAM_INVALID_CASES], ids=[c[0] for c in STREAM_INVALID_CASES])
def test_propose_stream_error_ends_stream(draft_stub, build, code, words, valid_first):
    sid = _sid("stream")
    bad_sid = sid + "-other" if valid_first else sid  # a fresh id for the bad request, so 'unknown session' is true
    requests = ([_propose(context=ctx(sid))] if valid_first else []) + [build(bad_sid), _propose(context=ctx(sid + "-never"))]
    responses = []
    try:
        with pytest.raises(grpc.RpcError) as ei:
            for response in draft_stub.ProposeStream(iter(requests), timeout=RPC_TIMEOUT):
                responses.append(response)
        assert len(responses) == (1 if valid_first else 0), "exactly the valid requests before the bad one are answered"
        assert_status(ei.value, code, *(w.format(sid=bad_sid) for w in words))
        if valid_first:
            # The stream pinned the first request's session; its end must drop it (asynchronously).
            probe = _propose(context=ctx(sid, prefix_len=1, prefix_hash=prefix_hash(PROMPT[:1]), new_tokens=PROMPT[1:]))
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


# --- 3. target Verify -----------------------------------------------------------------------------


def _row(ids, probs) -> common_pb2.DraftDistribution:
    return draft_probs.row(ids, probs)


GOOD_ROW = ([5, 6], [0.25, 0.75])


def _verify(session_id="badinput-target-invalid", context=None, draft_tokens=(5, 6), q=(), temperature=0.0, top_k=0, top_p=0.0,
            seed=11):
    return target_pb2.VerifyRequest(
        context=context if context is not None else ctx(session_id),
        draft_tokens=list(draft_tokens),
        q=list(q),
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
    )


def _verify_q(*rows):
    return _verify(q=[_row(*r) for r in rows], temperature=1.0)


VERIFY_INVALID_CASES = [
    ("draft_tokens_above_cap", lambda: _verify(draft_tokens=[5] * (MAX_K + 1)), ["draft_tokens", str(MAX_K + 1)]),
    ("q_fewer_rows_than_drafts", lambda: _verify_q(GOOD_ROW), ["q", "draft_tokens"]),
    ("q_more_rows_than_drafts", lambda: _verify_q(GOOD_ROW, GOOD_ROW, GOOD_ROW), ["q", "draft_tokens"]),
    ("q_rows_without_drafts", lambda: _verify(draft_tokens=[], q=[_row(*GOOD_ROW)], temperature=1.0), ["q", "draft_tokens"]),
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
    ("draft_token_out_of_vocab", lambda: _verify(draft_tokens=[5, VOCAB]), ["draft_tokens", str(VOCAB)]),
    ("draft_token_negative", lambda: _verify(draft_tokens=[-7]), ["draft_tokens", "-7"]),
    ("context_too_long", lambda: _verify(context=ctx("badinput-target-invalid", new_tokens=[1] * 1030)), ["context"]),
    ("context_plus_drafts_too_long",
     lambda: _verify(context=ctx("badinput-target-invalid", new_tokens=[1] * (MAX_CONTEXT - 1)), draft_tokens=[5, 6]),
     ["context"]),
    ("missing_context", lambda: target_pb2.VerifyRequest(draft_tokens=[5]), ["session_id"]),
    ("missing_session_id", lambda: _verify(context=ctx("")), ["session_id"]),
    ("session_id_too_long", lambda: _verify(context=ctx("t" * 129)), ["session_id"]),
    ("negative_prefix_len", lambda: _verify(context=ctx("badinput-target-invalid", prefix_len=-2)), ["prefix_len"]),
    ("empty_new_tokens", lambda: _verify(context=ctx("badinput-target-invalid", new_tokens=[])), ["new_tokens"]),
    ("new_token_out_of_vocab", lambda: _verify(context=ctx("badinput-target-invalid", new_tokens=[VOCAB + 100])),
     ["new_tokens", str(VOCAB + 100)]),
    ("temperature_negative", lambda: _verify(temperature=-1.0), ["temperature"]),
    ("temperature_nan", lambda: _verify(temperature=math.nan), ["temperature"]),
    ("top_k_negative", lambda: _verify(top_k=-4), ["top_k"]),
    ("top_p_above_1", lambda: _verify(top_p=1.5), ["top_p"]),
    ("top_p_nan", lambda: _verify(top_p=math.nan), ["top_p"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in VERIFY_INVALID_CASES], ids=[c[0] for c in VERIFY_INVALID_CASES])
def test_verify_invalid_argument(target_stub, build, words):
    err = unary_error(target_stub.Verify, build())
    assert_status(err, INVALID, *words)


def test_verify_unknown_session_failed_precondition(target_stub):
    sid = _sid("target-unknown")
    err = unary_error(target_stub.Verify, _verify(context=ctx(sid, prefix_len=2, prefix_hash=prefix_hash(PROMPT[:2]),
                                                              new_tokens=PROMPT[2:])))
    assert_status(err, PRECONDITION, sid)
    assert end_session(target_stub, sid) is False, "a rejected request must not create a session"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy_empty_q", "sampled_with_q"])
def test_verify_valid_then_prefix_mismatch(target_stub, sampled):
    sid = _sid("target-valid")
    try:
        if sampled:
            req = _verify(context=ctx(sid), q=[_row(*GOOD_ROW), _row([6, 7, 8], [0.2, 0.3, 0.5])], temperature=1.0)
        else:
            req = _verify(context=ctx(sid))
        resp = target_stub.Verify(req, timeout=RPC_TIMEOUT)
        n = resp.num_accepted
        assert 0 <= n <= 2
        assert 0 <= resp.next_token < VOCAB
        assert resp.cached_len == len(PROMPT) + n

        # The session now holds PROMPT + n accepted drafts: a wrong fingerprint or a longer prefix is refused.
        good = prefix_hash(PROMPT)
        bad = _verify(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good ^ 0xFF, new_tokens=[resp.next_token]))
        assert_status(unary_error(target_stub.Verify, bad), PRECONDITION, "prefix")
        too_long = resp.cached_len + 5
        bad = _verify(context=ctx(sid, prefix_len=too_long, prefix_hash=good, new_tokens=[resp.next_token]))
        assert_status(unary_error(target_stub.Verify, bad), PRECONDITION, "prefix_len", str(too_long))

        # ...and the right prefix still works.
        again = target_stub.Verify(_verify(context=ctx(sid, prefix_len=len(PROMPT), prefix_hash=good, new_tokens=[resp.next_token]),
                                           draft_tokens=[]), timeout=RPC_TIMEOUT)
        assert again.num_accepted == 0 and again.cached_len == len(PROMPT) + 1
    finally:
        assert end_session(target_stub, sid) is True


# --- 5. messages over the size limit --------------------------------------------------------------

BIG = MAX_MESSAGE + 1024 * 1024  # ~9 MiB


def test_verify_message_too_large(target_stub):
    req = _verify(context=ctx("v" * BIG))
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
    sid = _sid("after-big")
    try:
        resp = target_stub.Verify(_verify(context=ctx(sid)), timeout=RPC_TIMEOUT)
        assert resp.cached_len == len(PROMPT) + resp.num_accepted
    finally:
        end_session(target_stub, sid)


def test_propose_message_too_large(draft_stub):
    err = unary_error(draft_stub.Propose, _propose(context=ctx("p" * BIG)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    sid = _sid("after-big")
    try:
        assert len(draft_stub.Propose(_propose(context=ctx(sid)), timeout=RPC_TIMEOUT).tokens) == 3
    finally:
        end_session(draft_stub, sid)


def test_generate_message_too_large(generation_stub):
    req = generate_pb2.GenerateRequest(text="g" * BIG, max_new_tokens=4)
    err = generate_error(generation_stub, req)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"got {err.code().name}: {err.details()!r}"
    events = list(generation_stub.Generate(_gen(), timeout=RPC_TIMEOUT))
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
    greedy = list(generation_stub.Generate(_gen(num_speculative_tokens=k, temperature=0.0), timeout=RPC_TIMEOUT))
    expected = [t for e in greedy if e.HasField("chunk") for t in e.chunk.token_ids]
    events = _ok_or_invalid_temperature(lambda r, timeout: list(generation_stub.Generate(r, timeout=timeout)),
                                        _gen(num_speculative_tokens=k, temperature=temperature, seed=3), temperature)
    if events is not None:
        assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == expected, \
            "a near-zero temperature must reproduce greedy output"


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_propose_tiny_temperature(draft_stub, temperature):
    sid = _sid("draft-tiny-t")
    try:
        greedy = draft_stub.Propose(_propose(context=ctx(sid)), timeout=RPC_TIMEOUT)
        resp = _ok_or_invalid_temperature(draft_stub.Propose, _propose(context=ctx(sid), temperature=temperature, seed=3), temperature)
        if resp is not None:
            assert list(resp.tokens) == list(greedy.tokens)
            assert len(resp.q) == 0  # below GREEDY_TEMPERATURE a round is greedy: q is one-hot, not sent
    finally:
        end_session(draft_stub, sid)


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_verify_tiny_temperature(target_stub, temperature):
    sid = _sid("target-tiny-t")
    try:
        greedy = target_stub.Verify(_verify(context=ctx(sid), draft_tokens=[]), timeout=RPC_TIMEOUT)
        resp = _ok_or_invalid_temperature(target_stub.Verify, _verify(context=ctx(sid), draft_tokens=[], temperature=temperature, seed=3),
                                          temperature)
        if resp is not None:
            assert resp.next_token == greedy.next_token and resp.cached_len == len(PROMPT)
    finally:
        end_session(target_stub, sid)


# --- a client that walks away leaves nothing behind -----------------------------------------------


def test_generate_cancel_and_deadline(generation_stub, cluster):
    req = _gen(max_new_tokens=300, ignore_eos=True)
    call = generation_stub.Generate(req, timeout=RPC_TIMEOUT)
    assert next(call).HasField("chunk")
    call.cancel()
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as ei:
        list(generation_stub.Generate(req, timeout=0.05))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # (leftover sessions from these two are checked by the final test)


# --- 4. the servers are healthy afterwards (keep this test last) ---------------------------------


def test_zz_servers_healthy_after_bad_input(cluster):
    # A normal greedy generation through the coordinator.
    with Client(cluster.address, timeout_s=RPC_TIMEOUT) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=8, num_speculative_tokens=3)
    assert 1 <= len(out.token_ids) <= 8
    assert all(0 <= t < VOCAB for t in out.token_ids)
    if len(out.token_ids) < 8:
        assert out.token_ids[-1] == EOS and out.finish_reason == "eos"
    else:
        assert out.finish_reason in ("length", "eos")

    # Standard health check on all three servers.
    for port in (cluster.port, cluster.target_port, cluster.draft_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, f"port {port}: {resp.status}"

    # No leftover sessions (cleanup after streams and generations is asynchronous: poll).
    cluster.wait_no_sessions(5.0)
