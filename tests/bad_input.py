"""Bad input through the real gRPC servers (tests/test_bad_input_*.py): the servers' limits as the tests
pin them, valid requests to mutate, and checks that an error has the right status code and a message
naming the offending field. Raw stubs over grpc.insecure_channel are used (not specdec.client) so any
value can be sent; the stubs are tests/conftest.py's, on the random-draft cluster."""

from __future__ import annotations

import uuid

import grpc
import pytest

from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, generate_pb2, target_pb2

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


def new_session_id(tag: str) -> str:
    return f"{SESSION_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"


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


# --- valid requests (the cases are mutations of them) ----------------------------------------------


def generate_request(**fields) -> generate_pb2.GenerateRequest:
    """A valid small request (token ids prompt, 4 tokens, greedy) with `fields` overriding it."""
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.token_ids.ids.extend(PROMPT)
    for name, value in fields.items():
        if name == "stop":
            req.stop.extend(value)
        else:
            setattr(req, name, value)
    return req


def propose_request(session_id="badinput-draft-invalid", context=None, num_tokens=3, temperature=0.0, top_k=0, top_p=0.0,
                    seed=7):
    return draft_pb2.ProposeRequest(
        context=context if context is not None else ctx(session_id),
        num_tokens=num_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
    )


def verify_request(session_id="badinput-target-invalid", context=None, draft_tokens=(5, 6), q=(), temperature=0.0, top_k=0,
                   top_p=0.0, seed=11):
    return target_pb2.VerifyRequest(
        context=context if context is not None else ctx(session_id),
        draft_tokens=list(draft_tokens),
        q=list(q),
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
    )
