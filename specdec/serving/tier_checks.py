"""Request checks both tiers make, each an INVALID_ARGUMENT naming the field (FAILED_PRECONDITION for a
replica of another model pair). Each servicer calls them from the one method that turns its request into
an engine work item."""

from __future__ import annotations

import socket

import grpc

from specdec.core.errors import RequestError, check_token_ids, invalid_argument
from specdec.proto import common_pb2

MAX_SESSION_ID_LEN = 128


def check_context(engine, ctx: common_pb2.SessionContext, extra_tokens: int) -> None:
    """Validate a SessionContext; extra_tokens = tokens the request adds beyond new_tokens."""
    if not ctx.session_id:
        raise invalid_argument("context.session_id is required")
    if len(ctx.session_id) > MAX_SESSION_ID_LEN:
        raise invalid_argument(f"context.session_id is longer than {MAX_SESSION_ID_LEN} characters")
    if ctx.prefix_len < 0:
        raise invalid_argument(f"context.prefix_len must be >= 0, got {ctx.prefix_len}")
    if not ctx.new_tokens:
        raise invalid_argument("context.new_tokens must hold at least one token")
    check_token_ids(ctx.new_tokens, engine.vocab_size, "context.new_tokens")
    total = ctx.prefix_len + len(ctx.new_tokens) + extra_tokens
    if total > engine.max_context:
        raise invalid_argument(f"context: {total} tokens exceed the model's context of {engine.max_context}")
    if ctx.tokenizer_fingerprint and ctx.tokenizer_fingerprint != engine.tokenizer_fingerprint:
        raise tokenizer_mismatch(engine, ctx.tokenizer_fingerprint)


def tokenizer_mismatch(engine, theirs: str) -> RequestError:
    """FAILED_PRECONDITION for a request made with another tokenizer: this replica must not serve it.
    Names the replica (its host name: the pod's name on Kubernetes) and its model, for the operator."""
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"tokenizer mismatch: replica {socket.gethostname()} serves {engine.config.model.path} whose "
                        f"tokenizer fingerprint is {engine.tokenizer_fingerprint[:16]}, the request's is {theirs[:16]}; "
                        f"this replica belongs to another model pair: fix its --model")


def check_num_tokens(engine, k: int, field_name: str, minimum: int) -> None:
    cap = engine.config.max_draft_tokens
    if not minimum <= k <= cap:
        raise invalid_argument(f"{field_name} must be in [{minimum}, {cap}], got {k}")
