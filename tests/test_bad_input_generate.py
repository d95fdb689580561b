"""Bad input to the coordinator's Generate through the real gRPC servers: every malformed request gets
INVALID_ARGUMENT and a message naming the offending field, before any event is streamed; the request
the cases are mutations of is itself accepted. (Shared limits and helpers: tests/bad_input.py.)"""

from __future__ import annotations

import math

import pytest

from specdec.proto import generate_pb2
from tests.bad_input import (INVALID, MAX_K, MAX_NEW_CAP, MAX_PROMPT, RPC_TIMEOUT, VOCAB, assert_status, generate_error,
                             generate_request)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


def _no_prompt():
    return generate_pb2.GenerateRequest(max_new_tokens=4)


def _empty_text():
    req = generate_pb2.GenerateRequest(text="", max_new_tokens=4)
    assert req.WhichOneof("prompt") == "text"
    return req


def _empty(prompt: str):
    """The `prompt` oneof set to an empty chat or token_ids."""
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    getattr(req, prompt).SetInParent()
    assert req.WhichOneof("prompt") == prompt
    return req


def _chat_role(role: str):
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.chat.messages.add(role="user", content="Hello")
    req.chat.messages.add(role=role, content="Hi there")
    return req


def _token_ids(ids):
    req = generate_pb2.GenerateRequest(max_new_tokens=4)
    req.token_ids.ids.extend(ids)
    return req


GENERATE_CASES = [
    # (id, request builder, words the message must mention)
    ("no_prompt", _no_prompt, ["prompt"]),
    ("empty_text", _empty_text, ["text"]),
    ("empty_chat_messages", lambda: _empty("chat"), ["chat.messages"]),
    ("chat_unknown_role", lambda: _chat_role("robot"), ["chat.messages[1].role", "robot"]),
    ("chat_empty_role", lambda: _chat_role(""), ["chat.messages[1].role"]),
    ("empty_token_ids", lambda: _empty("token_ids"), ["token_ids"]),
    ("token_id_negative", lambda: _token_ids([1, -1, 3000]), ["token_ids", "-1"]),
    ("token_id_out_of_vocab", lambda: _token_ids([1, VOCAB, 3000]), ["token_ids", str(VOCAB)]),
    ("token_ids_too_long", lambda: _token_ids([1] + [2000] * MAX_PROMPT), ["max_prompt_tokens"]),
    ("text_too_long", lambda: generate_pb2.GenerateRequest(text="hello " * (MAX_PROMPT + 10), max_new_tokens=4),
     ["max_prompt_tokens"]),
    ("max_new_tokens_0", lambda: generate_request(max_new_tokens=0), ["max_new_tokens"]),
    ("max_new_tokens_negative", lambda: generate_request(max_new_tokens=-5), ["max_new_tokens", "-5"]),
    ("max_new_tokens_above_cap", lambda: generate_request(max_new_tokens=MAX_NEW_CAP + 1), ["max_new_tokens", str(MAX_NEW_CAP + 1)]),
    ("temperature_negative", lambda: generate_request(temperature=-0.1), ["temperature"]),
    ("temperature_nan", lambda: generate_request(temperature=math.nan), ["temperature"]),
    ("temperature_inf", lambda: generate_request(temperature=math.inf), ["temperature"]),
    ("top_k_negative", lambda: generate_request(top_k=-1), ["top_k"]),
    ("top_p_zero_explicit", lambda: generate_request(top_p=0.0), ["top_p"]),
    ("top_p_negative", lambda: generate_request(top_p=-0.5), ["top_p"]),
    ("top_p_above_1", lambda: generate_request(top_p=1.5), ["top_p"]),
    ("top_p_nan", lambda: generate_request(top_p=math.nan), ["top_p"]),
    ("num_speculative_tokens_negative", lambda: generate_request(num_speculative_tokens=-1), ["num_speculative_tokens"]),
    ("num_speculative_tokens_above_cap", lambda: generate_request(num_speculative_tokens=MAX_K + 1), ["num_speculative_tokens"]),
    ("num_speculative_nodes_negative", lambda: generate_request(num_speculative_nodes=-1), ["num_speculative_nodes", "-1"]),
    ("num_speculative_nodes_above_cap", lambda: generate_request(num_speculative_nodes=MAX_K + 1), ["num_speculative_nodes"]),
    ("num_speculative_nodes_below_k", lambda: generate_request(num_speculative_tokens=4, num_speculative_nodes=3),
     ["num_speculative_nodes (3)", "at least num_speculative_tokens (4)"]),
    ("num_speculative_nodes_penalised", lambda: generate_request(num_speculative_nodes=6, presence_penalty=0.5),
     ["num_speculative_nodes", "penalty"]),
    ("too_many_stop_strings", lambda: generate_request(stop=[f"s{i}" for i in range(17)]), ["stop"]),
    ("empty_stop_string", lambda: generate_request(stop=["ok", ""]), ["stop"]),
    ("stop_string_too_long", lambda: generate_request(stop=["x" * 257]), ["stop"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES])
def test_generate_invalid_argument(generation_stub, build, words):
    err = generate_error(generation_stub, build())
    assert_status(err, INVALID, *words)


def test_generate_valid_baseline(generation_stub):
    """The request the invalid cases are mutations of is itself accepted."""
    events = list(generation_stub.Generate(generate_request(), timeout=RPC_TIMEOUT))
    assert events and events[-1].HasField("result")
    ids = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    assert 1 <= len(ids) <= 4
